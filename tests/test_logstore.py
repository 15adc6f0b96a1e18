"""The Parquet log store: partitions by tenant, model and hour, readers that list only their
tenant's files, odd feature names, compaction that never shows a row twice, the same on a real
S3 API, and the log's export."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from monitoring import drift
from monitoring.logstore import COMPACTED, HOUR, LogStore, Partition, hour_of, log_store
from monitoring.prediction_log import (
    PREDICTIONS,
    compact_closed_hours,
    log_rows,
    records_table,
)
from monitoring.quality import logged_predictions
from registry.reference import set_reference_upload
from tenants.audit import Actor
from tests.factories import make_log, make_model, make_version

pytestmark = pytest.mark.backends


def record(tenant_id: int, model_id: int, at: datetime, request_id: str, **fields) -> dict:
    return {
        "tenant_id": tenant_id,
        "model_id": model_id,
        "version_id": 1,
        "request_id": request_id,
        "inputs": {"x": [1.0]},
        "latency_ms": 1.0,
        "status": 200,
        "created_at": at,
    } | fields


AT = datetime(2026, 12, 8, 13, 30, tzinfo=UTC)


def test_a_table_is_written_as_one_file_per_tenant_model_and_hour():
    store = log_store()
    rows = [
        record(1, 10, AT, "a"),
        record(1, 10, AT + timedelta(minutes=10), "b"),
        record(1, 10, AT + timedelta(hours=1), "c"),
        record(1, 11, AT, "d"),
        record(2, 20, AT, "e"),
    ]
    paths = store.write(PREDICTIONS, records_table(rows))
    relative = sorted(p[len(store.base) + 1 :].rsplit("/", 1)[0] for p in paths)
    assert relative == [
        "predictions/tenant=1/model=10/hour=2026-12-08T13",
        "predictions/tenant=1/model=10/hour=2026-12-08T14",
        "predictions/tenant=1/model=11/hour=2026-12-08T13",
        "predictions/tenant=2/model=20/hour=2026-12-08T13",
    ]
    # Pruned by path: one model, one hour.
    (one,) = store.files(PREDICTIONS, 1, [10], AT, AT)
    assert pq.read_table(one)["request_id"].to_pylist() == ["a", "b"]
    assert len(store.files(PREDICTIONS, 1)) == 3
    assert store.models(PREDICTIONS, 1) == [10, 11]
    assert store.hours(PREDICTIONS, 1, 10) == [hour_of(AT), hour_of(AT) + HOUR]
    # A long range lists the model's hours instead of asking for each hour of the range.
    assert len(store.files(PREDICTIONS, 1, [10], AT - timedelta(days=30), AT + HOUR)) == 2


def test_a_reader_only_ever_lists_its_own_tenants_files(world, onnx_bytes):
    mine = make_version(make_model(world.a, "clf"), onnx_bytes)
    theirs = make_version(make_model(world.b, "clf"), onnx_bytes)
    make_log(mine, "shared-id", scores=[0.1], inputs={"x": [1.0]})
    make_log(theirs, "shared-id", scores=[0.9], inputs={"x": [2.0]})
    make_log(theirs, "only-b", scores=[0.9], inputs={"x": [2.0]})
    store = log_store()
    assert all(f"/tenant={world.a.pk}/" in f for f in store.files(PREDICTIONS, world.a.pk))
    rows = logged_predictions(mine.model).page(0, 50)
    assert [(r.request_id, r.scores) for r in rows] == [("shared-id", [0.1])]
    # Even a model id of the other tenant, asked for under this tenant, finds nothing.
    assert store.files(PREDICTIONS, world.a.pk, [theirs.model_id]) == []
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.key_a}")
    listed = api.get("/api/v1/models/clf/predictions").json()
    assert [r["request_id"] for r in listed["results"]] == ["shared-id"]
    exported = api.get("/api/v1/models/clf/predictions/export", {"format": "csv"})
    assert [r["request_id"] for r in csv.DictReader(io.StringIO(read(exported)))] == ["shared-id"]


def read(response) -> str:
    return b"".join(response.streaming_content).decode()


def test_files_of_one_partition_with_different_features_are_read_by_name():
    store = log_store()
    store.write(PREDICTIONS, records_table([record(1, 10, AT, "old", inputs={"a": [1.0]})]))
    store.write(
        PREDICTIONS,
        records_table([record(1, 10, AT, "new", inputs={"a": [2.0], "b": [3.0, 4.0]})]),
    )
    files = store.files(PREDICTIONS, 1, [10])
    table = store.query(PREDICTIONS, files, "SELECT * FROM log ORDER BY request_id")
    assert [r["inputs"] for r in log_rows(table)] == [{"a": [2.0], "b": [3.0, 4.0]}, {"a": [1.0]}]


ODD = ['ag"e', "naïve ünïcode", "x'); DROP TABLE log; --", "f.nested"]


def test_odd_feature_names_break_neither_sql_nor_paths(world, onnx_bytes, rng):
    version = make_version(make_model(world.a, "odd"), onnx_bytes, feature_names=ODD)
    reference = {name: rng.normal(40, 10, 200).round(2).tolist() for name in ODD}
    set_reference_upload(
        version, Actor(None, "test"), columns=reference, scores=rng.random(200).tolist()
    )
    for i in range(4):
        make_log(
            version,
            f"odd-{i}",
            inputs={name: rng.normal(70, 10, 50).round(2).tolist() for name in ODD},
            scores=rng.random(50).tolist(),
            at=timezone.now() - timedelta(minutes=5),
        )
    store = log_store()
    assert all("ag" not in f and "DROP" not in f for f in store.files(PREDICTIONS, world.a.pk))
    report = drift.detect_drift(version)
    assert report is not None and report.rows_current == 200
    assert set(report.flagged) >= set(ODD)  # every odd column read, and drifted by 30
    (row,) = logged_predictions(version.model, request_id="odd-0").page(0, 1)
    assert set(row.inputs) == set(ODD)
    # An odd request id in a filter is a parameter, not SQL.
    assert logged_predictions(version.model, request_id="x' OR '1'='1").count() == 0


def test_compaction_merges_a_closed_hours_files_and_no_reader_sees_a_row_twice(monkeypatch):
    store = log_store()
    for i in range(5):
        store.write(PREDICTIONS, records_table([record(1, 10, AT, f"r{i}")]))
    partition = Partition(1, 10, hour_of(AT))
    before = store.files(PREDICTIONS, 1, [10])
    assert len(before) == 5
    # A reader between the merged file's write and the deletes: the replaced files are left out.
    seen: list[list[str]] = []
    original = LogStore._delete

    def delete(self, path):
        seen.append(self.files(PREDICTIONS, 1, [10]))
        return original(self, path)

    monkeypatch.setattr(LogStore, "_delete", delete)
    assert store.compact(PREDICTIONS, partition) == 5
    assert len(seen) == 5
    for listing in seen:
        rows = store.query(PREDICTIONS, listing, "SELECT request_id FROM log")
        assert sorted(rows["request_id"].to_pylist()) == [f"r{i}" for i in range(5)]
    (merged,) = store.files(PREDICTIONS, 1, [10])
    assert merged.rsplit("/", 1)[-1].startswith(COMPACTED)


def test_the_compaction_task_merges_closed_hours_only():
    store = log_store()
    now = datetime(2026, 12, 8, 15, 20, tzinfo=UTC)
    for at in (now - timedelta(hours=2), now - timedelta(minutes=10)):  # closed, open
        for i in range(3):
            store.write(PREDICTIONS, records_table([record(1, 10, at, f"{at.hour}-{i}")]))
    assert compact_closed_hours(now) == 1
    by_hour = {h: store.files(PREDICTIONS, 1, [10], h, h) for h in store.hours(PREDICTIONS, 1, 10)}
    assert sorted(len(files) for files in by_hour.values()) == [1, 3]
    assert compact_closed_hours(now) == 0  # one file left: nothing to merge


def test_the_log_on_a_real_s3_api(settings):
    from tests.s3_server import s3_server

    with s3_server() as server:
        bucket = server.new_bucket()
        settings.SWITCHYARD_STORAGE = "s3"
        settings.STORAGES = settings.STORAGES | {
            "default": {
                "BACKEND": "storages.backends.s3.S3Storage",
                "OPTIONS": {
                    "bucket_name": bucket,
                    "endpoint_url": server.endpoint,
                    "region_name": "us-east-1",
                },
            }
        }
        settings.SWITCHYARD_LOG_ROOT = ""
        store = log_store()
        assert not store.local and store.base == f"{bucket}/logs"
        store.write(PREDICTIONS, records_table([record(1, 10, AT, "s3-a", inputs={"a": [1.0]})]))
        store.write(
            PREDICTIONS, records_table([record(1, 10, AT, "s3-b", inputs={"b": [2.0, 3.0]})])
        )
        keys = [o["Key"] for o in server.client().list_objects_v2(Bucket=bucket)["Contents"]]
        assert all(k.startswith("logs/predictions/tenant=1/model=10/hour=") for k in keys)
        files = store.files(PREDICTIONS, 1, [10], AT, AT)
        table = store.query(PREDICTIONS, files, "SELECT * FROM log ORDER BY request_id")
        assert [r["inputs"] for r in log_rows(table)] == [{"a": [1.0]}, {"b": [2.0, 3.0]}]
        assert store.compact(PREDICTIONS, Partition(1, 10, hour_of(AT))) == 2
        assert len(store.files(PREDICTIONS, 1, [10])) == 1
        assert store.drop_before(PREDICTIONS, 1, 10, AT + HOUR) == 1
        assert store.files(PREDICTIONS, 1, [10]) == []


def test_the_export_is_csv_or_parquet_over_a_time_range(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    now = timezone.now()
    make_log(version, "old", scores=[0.1], inputs={"x": [1.0]}, at=now - timedelta(days=2))
    make_log(version, "new", scores=[0.2], inputs={"x": [2.0], "s": ["a"]}, at=now)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.key_a}")
    url = "/api/v1/models/clf/predictions/export"
    default = list(csv.DictReader(io.StringIO(read(api.get(url)))))
    assert [(r["request_id"], r["version"], r["f.x"]) for r in default] == [("new", "1", "[2.0]")]
    since = (now - timedelta(days=3)).isoformat()
    parquet = api.get(url, {"format": "parquet", "since": since})
    assert parquet["Content-Disposition"].startswith('attachment; filename="clf-predictions')
    table = pq.read_table(pa.BufferReader(b"".join(parquet.streaming_content)))
    assert table["request_id"].to_pylist() == ["old", "new"]
    assert "tenant_id" not in table.column_names
    for bad in ({"format": "xlsx"}, {"since": "yesterday"}, {"since": now, "until": since}):
        response = api.get(url, bad)
        assert response.status_code == 400, bad
    assert api.get("/api/v1/models/nope/predictions/export").status_code == 404
    page = Client()
    page.force_login(world.viewer_a)
    got = page.get("/models/clf/predictions/export/", {"format": "csv"})
    assert got.status_code == 200 and "new" in read(got)
    assert page.get("/models/clf/predictions/export/", {"format": "x"}).status_code == 400
    assert page.get("/models/clf/predictions/export/", {"until": "soon"}).status_code == 400
    other = Client()
    other.force_login(world.outsider)
    assert other.get("/models/clf/predictions/export/").status_code == 403


def test_typed_columns_keep_a_single_floats_own_precision():
    table = records_table([record(1, 10, AT, "p")])
    table = table.set_column(
        table.schema.get_field_index("f.x"),
        "f.x",
        pa.array([[0.1]], pa.list_(pa.float32())),
    )
    assert log_rows(table)[0]["inputs"] == {"x": [0.1]}
    assert float(np.float32(0.1)) != 0.1  # what a naive conversion would have logged
