"""The prediction log: sampling, the records it builds (columns, scores, personal data), the
bounded buffer, the batch writer against a working, failing and locked database, retention."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import random
import time
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet
import pytest
from django.utils import timezone
from prometheus_client import REGISTRY

from gateway import predlog, tracing
from gateway.predlog import REDACTED, PredictionLogger, build_record
from gateway.routes import InputSpec, Route, route_of
from monitoring.logstore import LogStore, log_store
from monitoring.models import Feedback
from monitoring.prediction_log import PREDICTIONS, log_rows, purge_expired_logs
from monitoring.tasks import purge_prediction_logs
from registry.models import TaskKind
from tests.factories import logged_rows, make_model, make_version

pytestmark = pytest.mark.backends

KEY = b"test-key"
FEATURES = ("amount", "hour", "merchant_risk", "account_age_days")


def make_route(
    *,
    task: str = TaskKind.CLASSIFIER,
    outputs: tuple[dict, ...] = ({"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]},),
    feature_names: tuple[str, ...] = FEATURES,
    rate: float = 1.0,
    personal: dict | None = None,
    ids: tuple[int, int, int] = (1, 1, 1),
) -> Route:
    tenant_id, model_id, version_id = ids
    return Route(
        tenant_id=tenant_id,
        model_name="fraud",
        version_id=version_id,
        model_id=model_id,
        version=1,
        task=task,
        inputs=(InputSpec("features", "FP32", np.dtype("<f4"), (-1, len(feature_names) or 4)),),
        outputs=outputs,
        feature_names=feature_names,
        log_sample_rate=rate,
        personal_fields=tuple(sorted((personal or {}).items())),
    )


def record(route: Route, names, arrays, outputs, **overrides) -> dict:
    fields = dict(
        arm="candidate",
        request_id="req-1",
        trace_id="ab" * 16,
        names=names,
        arrays=arrays,
        outputs=outputs,
        latency_s=0.0125,
        status=200,
        hash_key=KEY,
    )
    return build_record(route, **(fields | overrides))


def offer(logger: PredictionLogger, route: Route, n: int = 1, request_id: str = "req") -> bool:
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    probs = np.tile(np.array([[0.8, 0.2]], dtype=np.float32), (n, 1))
    return logger.offer(
        route,
        arm=None,
        request_id=request_id,
        trace_id="",
        names=[route.inputs[0].name],
        arrays=[x],
        outputs=[(route.outputs[0]["name"], probs)],
        latency_s=0.001,
        status=200,
    )


def counter(outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "switchyard_prediction_log_records_total", {"outcome": outcome}
    )
    return value or 0.0


# Sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 1.0])
def test_the_share_logged_follows_the_sample_rate(rate):
    random.seed(42)
    logger = PredictionLogger(capacity=100_000, autostart=False)
    route = make_route(rate=rate)
    n = 20_000
    taken = sum(offer(logger, route) for _ in range(n))
    # Binomial: five standard deviations either side (zero width at rates 0 and 1).
    tolerance = 5 * (n * rate * (1 - rate)) ** 0.5
    assert abs(taken - n * rate) <= tolerance
    assert logger.pending == taken


def test_an_offer_only_queues_the_tensors_the_writer_builds_the_rows(monkeypatch):
    built: list[str] = []
    original = predlog.build_table

    def spy(samples, hash_key):
        built.extend(s.request_id for s in samples)
        return original(samples, hash_key)

    monkeypatch.setattr(predlog, "build_table", spy)
    logger = PredictionLogger(autostart=False)
    for i in range(3):
        assert offer(logger, make_route(rate=1.0), request_id=f"r{i}")
    assert offer(logger, make_route(rate=0.0), request_id="unsampled") is False
    assert built == [] and logger.pending == 3  # nothing converted on the request's thread
    logger.write_pending()
    assert built == ["r0", "r1", "r2"] and logger.written == 3
    assert [r["request_id"] for r in logged_rows()] == ["r0", "r1", "r2"]


# Records ---------------------------------------------------------------------------------------


def test_a_tabular_input_with_feature_names_gives_one_column_per_feature():
    x = np.array([[12.5, 3, 0.7, 400], [99.0, 23, 0.1, 2]], dtype=np.float32)
    probs = np.array([[0.9, 0.1], [0.25, 0.75]], dtype=np.float32)
    row = record(make_route(), ["features"], [x], [("probabilities", probs)])
    # float32 values are logged as their shortest text: 0.7, not 0.699999988079071.
    assert row["inputs"] == {
        "amount": [12.5, 99.0],
        "hour": [3.0, 23.0],
        "merchant_risk": [0.7, 0.1],
        "account_age_days": [400.0, 2.0],
    }
    assert row["scores"] == [0.1, 0.75]  # the positive class
    assert row["outputs"] == {"probabilities": [[0.9, 0.1], [0.25, 0.75]]}
    assert (row["arm"], row["request_id"], row["status"]) == ("candidate", "req-1", 200)
    assert row["latency_ms"] == pytest.approx(12.5)
    assert (row["tenant_id"], row["model_id"], row["version_id"]) == (1, 1, 1)


def test_inputs_without_names_are_numbered_and_single_columns_keep_the_input_name():
    route = make_route(feature_names=())
    x = np.array([[1, 2], [3, 4]], dtype=np.float32)
    ages = np.array([[30], [41]], dtype=np.int64)
    country = np.array([b"FR", b"D\x00E"], dtype=object)
    image = np.zeros((2, 3, 8, 8), dtype=np.float32)
    row = record(
        route,
        ["x", "age", "country", "image"],
        [x, ages, country, image],
        [("probabilities", np.array([[0.5, 0.5], [0.1, 0.9]]))],
    )
    assert row["inputs"] == {
        "x[0]": [1.0, 3.0],
        "x[1]": [2.0, 4.0],
        "age": [30, 41],
        "country": ["FR", "D\ufffdE"],  # no NUL: PostgreSQL's JSON refuses it
        "image": {"shape": [2, 3, 8, 8], "dtype": "float32"},  # the shape only, not the pixels
    }


def test_classifier_logits_become_probabilities_and_many_classes_score_their_top_class():
    logits = np.array([[0.0, 0.0], [0.0, np.log(3.0)]], dtype=np.float32)
    row = record(make_route(), ["features"], [np.zeros((2, 4))], [("probabilities", logits)])
    assert row["scores"] == [pytest.approx(0.5), pytest.approx(0.75)]  # softmax, column 1

    three = ({"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]},)
    probs = np.array([[0.2, 0.7, 0.1], [0.5, 0.3, 0.2]], dtype=np.float32)
    row = record(
        make_route(outputs=three), ["features"], [np.zeros((2, 4))], [("probabilities", probs)]
    )
    assert row["scores"] == [pytest.approx(0.7), pytest.approx(0.5)]


def test_a_classifier_scores_from_its_probabilities_not_its_label_output():
    outputs = (
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]},
    )
    row = record(
        make_route(outputs=outputs),
        ["features"],
        [np.zeros((1, 4))],
        [("label", np.array([1])), ("probabilities", np.array([[0.3, 0.7]]))],
    )
    assert row["scores"] == [pytest.approx(0.7)]
    assert row["outputs"] == {"label": [1], "probabilities": [[0.3, 0.7]]}


def test_a_regressor_scores_its_value_and_non_finite_numbers_are_logged_as_null():
    route = make_route(
        task=TaskKind.REGRESSOR, outputs=({"name": "y", "datatype": "FP32", "shape": [-1, 1]},)
    )
    x = np.array([[np.nan, 1, 2, 3]], dtype=np.float32)
    y = np.array([[2.5], [np.inf]], dtype=np.float32)
    row = record(route, ["features"], [np.vstack([x, x])], [("y", y)])
    assert row["scores"] == [2.5, None]
    assert row["outputs"] == {"y": [[2.5], [None]]}
    assert row["inputs"]["amount"] == [None, None]


def test_an_error_is_logged_with_its_inputs_and_no_outputs():
    row = record(make_route(), ["features"], [np.ones((1, 4))], None, status=400)
    assert (row["status"], row["outputs"], row["scores"]) == (400, {}, [])
    assert row["inputs"]["amount"] == [1.0]


def test_personal_fields_are_redacted_or_replaced_by_a_keyed_hash():
    route = make_route(personal={"amount": "redact", "account_age_days": "hash"})
    x = np.array([[12.5, 3, 0.7, 400], [99.0, 23, 0.1, 400]], dtype=np.float32)
    row = record(route, ["features"], [x], None)
    assert row["inputs"]["amount"] == [REDACTED, REDACTED]
    hashed = row["inputs"]["account_age_days"]
    assert hashed[0] == hmac.new(KEY, b"400.0", hashlib.sha256).hexdigest()
    assert hashed[0] == hashed[1]  # equal values hash equal, so joins on the field still work
    assert "400" not in str(hashed)
    other_key = record(route, ["features"], [x], None, hash_key=b"another key")
    assert other_key["inputs"]["account_age_days"][0] != hashed[0]
    assert row["inputs"]["hour"] == [3.0, 23.0]  # not personal: kept


def test_marking_an_input_personal_covers_all_of_its_columns():
    route = make_route(feature_names=(), personal={"email": "hash", "x": "redact"})
    email = np.array([b"a@example.com"], dtype=object)
    row = record(route, ["email", "x"], [email, np.ones((1, 2))], None)
    assert row["inputs"]["x[0]"] == row["inputs"]["x[1]"] == [REDACTED]
    assert row["inputs"]["email"] == [hmac.new(KEY, b"a@example.com", hashlib.sha256).hexdigest()]


def test_the_hash_key_comes_from_settings_or_else_from_the_secret_key(settings):
    settings.SWITCHYARD_LOG_HASH_KEY = "configured"
    assert PredictionLogger(autostart=False).hash_key == b"configured"
    settings.SWITCHYARD_LOG_HASH_KEY = ""
    derived = PredictionLogger(autostart=False).hash_key
    assert derived and settings.SECRET_KEY.encode() not in derived
    settings.SECRET_KEY = "another secret"
    assert PredictionLogger(autostart=False).hash_key != derived


# Buffer ----------------------------------------------------------------------------------------


def test_a_full_buffer_drops_and_counts_and_offer_returns_at_once():
    logger = PredictionLogger(capacity=10, autostart=False)
    route = make_route()
    before = counter("dropped_buffer_full")
    assert all(offer(logger, route) for _ in range(10))
    refused = [offer(logger, route) for _ in range(1000)]  # no writer running: nothing frees
    assert not any(refused)
    assert logger.pending == 10
    assert logger.dropped_buffer_full == 1000
    assert counter("dropped_buffer_full") - before == 1000


# Writer ----------------------------------------------------------------------------------------


@pytest.fixture
def served(db, world, onnx_bytes):
    """Tenant A's model ``clf`` (every request logged) with v1 in production, and its route."""
    model = make_model(world.a, "clf")
    model.log_sample_rate = 1.0
    model.save()
    return route_of(make_version(model, onnx_bytes))


def test_the_writer_thread_writes_a_file_per_partition_per_batch(world, served, monkeypatch):
    sizes: list[int] = []
    original = LogStore.put

    def spy(store, piece, metadata=None):
        original(store, piece, metadata)
        ours = [r for r in piece.table["request_id"].to_pylist() if r.startswith("req-")]
        if ours:
            sizes.append(len(ours))

    monkeypatch.setattr(LogStore, "put", spy)
    logger = PredictionLogger(capacity=1000, batch_size=4, flush_s=0.05)
    for i in range(10):
        assert offer(logger, served, n=2, request_id=f"req-{i}")
    assert logger.flush(timeout=10)
    assert logger.written == 10 and logger.pending == 0
    assert sum(sizes) == 10 and max(sizes) <= 4
    rows = logged_rows(world.a.pk)
    assert sorted(r["request_id"] for r in rows) == sorted(f"req-{i}" for i in range(10))
    one = next(r for r in rows if r["request_id"] == "req-3")
    assert (one["tenant_id"], one["model_id"], one["version_id"]) == (
        world.a.pk,
        served.model_id,
        served.version_id,
    )
    assert one["inputs"] == {
        "x[0]": [0.0, 4.0],
        "x[1]": [1.0, 5.0],
        "x[2]": [2.0, 6.0],
        "x[3]": [3.0, 7.0],
    }
    assert one["scores"] == [0.2, 0.2]  # float32 read back at its own precision
    assert one["outputs"] == {"y": [[0.8, 0.2]] * 2}
    assert one["rows"] == 2
    # Partitioned by tenant, model and hour; the numeric features typed, not JSON.
    files = log_store().files(PREDICTIONS, world.a.pk, [served.model_id])
    assert files and all(f"/tenant={world.a.pk}/model={served.model_id}/hour=" in f for f in files)
    schema = pa.unify_schemas([pa.parquet.read_schema(f) for f in files])
    assert schema.field("f.x[0]").type == pa.list_(pa.float32())
    assert schema.field("o.y").type == pa.list_(pa.list_(pa.float32()))


def test_the_writer_flushes_on_its_interval_without_being_asked(served):
    logger = PredictionLogger(capacity=1000, batch_size=500, flush_s=0.05)
    offer(logger, served, request_id="lonely")
    wait_until(lambda: logger.written == 1, 5)
    assert [r["request_id"] for r in logged_rows()] == ["lonely"]


@contextmanager
def storage_down(monkeypatch, error: Exception | None = None):
    """Every write to the log store fails as a storage that does not answer fails (pyarrow's
    OSError after its request timeout) until the block ends. The real stall, a stopped S3
    server, is tests/e2e/test_predlog_stall.py's."""
    original = LogStore.put
    state = {"down": True, "tries": 0}

    def put(store, piece, metadata=None):
        if state["down"]:
            state["tries"] += 1
            raise error or OSError("AWS Error NETWORK_CONNECTION: request timed out")
        return original(store, piece, metadata)

    monkeypatch.setattr(LogStore, "put", put)
    try:
        yield state
    finally:
        state["down"] = False


def test_a_failing_storage_keeps_the_batch_and_writes_it_once_it_answers(served, monkeypatch):
    logger = PredictionLogger(capacity=1000, batch_size=100, flush_s=60)
    retries_before = REGISTRY.get_sample_value("switchyard_prediction_log_write_retries_total")
    with storage_down(monkeypatch) as state:
        for i in range(5):
            offer(logger, served, request_id=f"kept-{i}")
        for _ in range(3):
            assert logger.write_pending() is False
        assert state["tries"] == 3
    assert logger.write_pending() is True
    assert logger.retries == 3 and logger.written == 5 and logger.dropped == 0
    after = REGISTRY.get_sample_value("switchyard_prediction_log_write_retries_total")
    assert after - (retries_before or 0) == 3
    logged = [r["request_id"] for r in logged_rows()]
    assert sorted(logged) == [f"kept-{i}" for i in range(5)]  # each once


def test_a_batch_partly_written_before_a_stall_writes_only_the_rest_under_the_same_names(
    world, served, onnx_bytes, monkeypatch
):
    """Two partitions (two models) in one batch: the first file lands, the second fails; the
    retry writes the second only, under the name it was given, so no row is written twice."""
    other = make_model(world.a, "other")
    second = dataclasses.replace(route_of(make_version(other, onnx_bytes)), log_sample_rate=1.0)
    logger = PredictionLogger(capacity=1000, batch_size=100, flush_s=60)
    offer(logger, served, request_id="first")
    offer(logger, second, request_id="second")
    original = LogStore.put
    paths: list[str] = []

    def put(store, piece, metadata=None):
        paths.append(piece.path)
        if len(paths) == 2:
            raise OSError("connection reset")
        return original(store, piece, metadata)

    monkeypatch.setattr(LogStore, "put", put)
    assert logger.write_pending() is False
    assert logger.write_pending() is True
    assert paths[2] == paths[1] and len(paths) == 3
    assert sorted(r["request_id"] for r in logged_rows()) == ["first", "second"]
    assert logger.written == 2 and logger.retries == 1


def test_a_storage_that_stays_down_keeps_the_batch_in_the_buffer(monkeypatch):
    logger = PredictionLogger(capacity=10, batch_size=4, autostart=False)
    route = make_route()
    with storage_down(monkeypatch):
        for i in range(6):
            offer(logger, route, request_id=f"r{i}")
        assert logger.write_pending() is False
        assert logger.write_pending() is False
        assert logger.pending == 6 and logger.retries == 2 and logger.dropped == 0
        # The kept records count against the capacity: the buffer stays bounded.
        assert sum(offer(logger, route) for _ in range(10)) == 4
        assert logger.dropped_buffer_full == 6 and logger.pending == 10


def test_what_a_down_storage_has_not_taken_at_shutdown_is_counted_as_lost(monkeypatch):
    logger = PredictionLogger(capacity=100, batch_size=4, flush_s=0.05)
    before = counter("dropped_at_shutdown")
    with storage_down(monkeypatch):
        for i in range(7):
            offer(logger, make_route(), request_id=f"r{i}")
        assert logger.close(timeout=0.3) == 7
    assert logger.dropped_at_shutdown == 7 and logger.written == 0
    assert counter("dropped_at_shutdown") - before == 7


def test_retries_back_off_doubling_up_to_a_cap():
    delays = [predlog.retry_delay(0.0)]
    for _ in range(8):
        delays.append(predlog.retry_delay(delays[-1]))
    assert delays[0] == predlog.RETRY_FIRST_S
    assert delays[1] == 2 * predlog.RETRY_FIRST_S
    assert delays == sorted(delays) and delays[-1] == predlog.RETRY_MAX_S


def test_a_prediction_that_cannot_be_recorded_is_dropped_and_counted_not_its_batch(served):
    logger = PredictionLogger(capacity=1000, batch_size=100, flush_s=60)
    before = counter("dropped_unrecordable")
    offer(logger, served, request_id="fine-1")
    logger.offer(
        served,
        arm=None,
        request_id="odd",
        trace_id="",
        names=["x"],
        arrays=[np.zeros((1, 4), dtype=np.complex64)],  # no JSON or Parquet number for these
        outputs=None,
        latency_s=0.001,
        status=200,
    )
    offer(logger, served, request_id="fine-2")
    assert logger.flush(timeout=10)
    assert logger.written == 2 and logger.dropped_unrecordable == 1
    assert counter("dropped_unrecordable") - before == 1
    assert sorted(r["request_id"] for r in logged_rows()) == ["fine-1", "fine-2"]


def test_a_file_the_storage_refuses_loses_only_its_own_rows(world, served, onnx_bytes, monkeypatch):
    """An error that is not the storage's (Arrow cannot write the file) is not retried: that
    partition's rows are counted as rejected, the batch's other files are written."""
    other = route_of(make_version(make_model(world.a, "other"), onnx_bytes))
    other = dataclasses.replace(other, log_sample_rate=1.0)
    original = LogStore.put

    def put(store, piece, metadata=None):
        if piece.partition.model_id == other.model_id:
            raise pa.ArrowInvalid("cannot write this file")
        return original(store, piece, metadata)

    monkeypatch.setattr(LogStore, "put", put)
    logger = PredictionLogger(capacity=1000, batch_size=100, flush_s=60)
    before = counter("dropped_rejected")
    offer(logger, served, request_id="fine-1")
    offer(logger, other, request_id="refused")
    offer(logger, served, request_id="fine-2")
    assert logger.flush(timeout=10)
    assert logger.written == 2 and logger.dropped_rejected == 1 and logger.retries == 0
    assert counter("dropped_rejected") - before == 1
    assert sorted(r["request_id"] for r in logged_rows()) == ["fine-1", "fine-2"]


def samples_of(route: Route, requests: list[tuple[np.ndarray, list]]) -> list[predlog.Sample]:
    return [
        predlog.Sample(route, "stable", f"r{i}", "t", ["features"], [x], outs, 0.002, 200, 1e9)
        for i, (x, outs) in enumerate(requests)
    ]


STACKED_CASES = [
    (make_route(), lambda n: [("probabilities", np.full((n, 2), 0.5, np.float32))]),
    (  # logits, several outputs, a 1-D one, personal fields
        make_route(personal={"amount": "hash", "hour": "redact"}),
        lambda n: [
            ("probabilities", np.linspace(-3, 3, 2 * n).reshape(n, 2)),
            ("label", np.arange(n)),
        ],
    ),
    (
        make_route(
            task=TaskKind.REGRESSOR,
            outputs=({"name": "value", "datatype": "FP64", "shape": [-1, 1]},),
        ),
        lambda n: [("value", np.arange(n, dtype=np.float64).reshape(n, 1) / 3)],
    ),
]


def stacked_samples(route, outputs_of) -> list[predlog.Sample]:
    rng = np.random.default_rng(3)
    requests = []
    for n in (1, 3, 1, 2):
        x = rng.normal(size=(n, 4)).astype(np.float32)
        x[0, 2] = np.nan  # logged as null either way
        requests.append((x, outputs_of(n)))
    return samples_of(route, requests)


@pytest.mark.parametrize("route, outputs_of", STACKED_CASES)
def test_records_built_together_equal_records_built_one_by_one(route, outputs_of):
    samples = stacked_samples(route, outputs_of)
    assert len({predlog.stack_key(s) for s in samples}) == 1
    together = list(predlog.build_records(samples, KEY))
    assert together == [s.record(KEY) for s in samples]
    assert [len(r["inputs"]["amount"]) for r in together] == [1, 3, 1, 2]


@pytest.mark.parametrize("route, outputs_of", STACKED_CASES)
def test_the_rows_built_from_stacked_tensors_read_back_as_each_samples_record(route, outputs_of):
    samples = stacked_samples(route, outputs_of)
    table = predlog.build_table(samples, KEY)
    read = log_rows(table)
    for row, sample in zip(read, samples, strict=True):
        expected = sample.record(KEY)
        for name in ("inputs", "outputs", "scores", "request_id", "arm", "status"):
            assert row[name] == expected[name], name
        assert row["created_at"] == expected["created_at"]
        assert row["rows"] == len(sample.arrays[0])
    # Personal fields stay out of the typed columns: only their redacted or hashed text is kept.
    personal = dict(route.personal_fields)
    assert not {f"f.{name}" for name in personal} & set(table.column_names)


def test_samples_that_cannot_be_stacked_are_built_alone():
    route = make_route()
    x = np.zeros((2, 4), np.float32)
    probs = np.full((2, 2), 0.5, np.float32)
    key = predlog.stack_key
    assert key(samples_of(route, [(x, [("probabilities", probs)])])[0]) is not None
    images = samples_of(route, [(np.zeros((2, 3, 3)), [("probabilities", probs)])])[0]
    text = samples_of(route, [(x, [("probabilities", np.array([["a", "b"]] * 2))])])[0]
    uneven = samples_of(route, [(x, [("probabilities", probs[:1])])])[0]
    assert key(images) is None and key(text) is None and key(uneven) is None
    wider = samples_of(route, [(np.zeros((2, 5), np.float32), [("probabilities", probs)])])[0]
    assert key(wider) != key(samples_of(route, [(x, [("probabilities", probs)])])[0])


def test_a_group_that_fails_to_build_together_is_built_one_by_one(monkeypatch):
    def broken(samples, hash_key):
        raise ValueError("cannot stack")

    monkeypatch.setattr(predlog, "build_table", broken)
    logger = PredictionLogger(autostart=False)
    route = make_route()
    for i in range(3):
        offer(logger, route, n=2, request_id=f"r{i}")
    logger.write_pending()
    rows = logged_rows()
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2"]
    assert rows[0]["inputs"]["amount"] == [0.0, 4.0]
    assert logger.written == 3 and logger.dropped == 0


def test_a_file_appears_whole_and_no_temporary_file_is_left_or_listed(monkeypatch):
    logger = PredictionLogger(autostart=False)
    offer(logger, make_route(), request_id="whole")
    store = log_store()
    seen: list[str] = []
    original = pa.parquet.write_table

    def write_table(table, where, **kwargs):
        original(table, where, **kwargs)
        # Written but not yet renamed: the file only exists under its hidden name, which no
        # listing takes.
        assert where.rsplit("/", 1)[-1].startswith(".")
        seen.extend(store.files(PREDICTIONS, 1))

    monkeypatch.setattr(pa.parquet, "write_table", write_table)
    logger.write_pending()
    assert seen == []
    (path,) = store.files(PREDICTIONS, 1)
    folder = path.rsplit("/", 1)[0]
    infos = store.fs.get_file_info(pa.fs.FileSelector(folder))
    assert [i.path for i in infos] == [path]


def test_the_prediction_log_can_be_switched_off_per_process(settings, world):
    """SWITCHYARD_PREDICTION_LOG=0: a process that logs nothing, whatever the sampling."""
    from gateway.metrics import Observed
    from gateway.state import GatewayState

    route = make_route(rate=1.0)
    for enabled, pending in ((True, 1), (False, 0)):
        settings.SWITCHYARD_PREDICTION_LOG = enabled
        state = GatewayState()
        state.predlog = PredictionLogger(autostart=False)
        observed = Observed(tracing.start_trace(None, None))
        observed.route, observed.names = route, ["features"]
        observed.arrays, observed.outputs = [np.ones((1, 4), np.float32)], None
        state.observe(observed, 200)
        assert state.predlog.pending == pending


def test_a_stall_the_buffer_outlasts_loses_nothing(served, monkeypatch):
    logger = PredictionLogger(capacity=1000, batch_size=5, flush_s=0.05)
    with storage_down(monkeypatch):
        for i in range(200):
            assert offer(logger, served, request_id=f"stalled-{i}")  # never waits
            time.sleep(0.002)
        assert logger.flush(timeout=0.5) is False  # still down: kept, not dropped
        wait_until(lambda: logger.retries > 0, 10)
        assert logger.written == 0 and logger.dropped == 0
    assert logger.flush(timeout=30)
    assert logger.written == 200 and logger.dropped == 0
    logged = [r["request_id"] for r in logged_rows()]
    assert sorted(logged) == sorted(f"stalled-{i}" for i in range(200))


def test_a_stall_longer_than_the_buffer_lasts_drops_only_new_offers_and_counts_them(
    served, monkeypatch
):
    logger = PredictionLogger(capacity=20, batch_size=5, flush_s=0.05)
    before = counter("dropped_buffer_full")
    with storage_down(monkeypatch):
        taken = [offer(logger, served, request_id=f"stalled-{i}") for i in range(200)]
        wait_until(lambda: logger.retries > 0, 10)
    assert taken == [True] * 20 + [False] * 180  # the oldest are kept, never overwritten
    assert logger.flush(timeout=30)
    assert logger.written == 20 and logger.dropped_buffer_full == 180
    assert counter("dropped_buffer_full") - before == 180

    offer(logger, served, request_id="after")
    assert logger.flush(timeout=10)
    logged = {r["request_id"] for r in logged_rows()}
    assert logged == {f"stalled-{i}" for i in range(20)} | {"after"}


def wait_until(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# Retention -------------------------------------------------------------------------------------


def make_log(route: Route, request_id: str, age: timedelta) -> None:
    from monitoring.prediction_log import write_records

    write_records(
        [
            {
                "tenant_id": route.tenant_id,
                "model_id": route.model_id,
                "version_id": route.version_id,
                "request_id": request_id,
                "inputs": {},
                "latency_ms": 1.0,
                "status": 200,
                "created_at": timezone.now() - age,
            }
        ]
    )


def test_retention_drops_each_models_old_hours_by_its_own_days_and_old_feedback(world, onnx_bytes):
    short = make_model(world.a, "short")
    short.log_retention_days = 1
    short.save()
    long = make_model(world.a, "long")
    long.log_retention_days = 30
    long.save()
    routes = {m.name: route_of(make_version(m, onnx_bytes)) for m in (short, long)}
    for name, route in routes.items():
        for age_days in (0, 2, 2, 2, 40):
            make_log(route, f"{name}-{age_days}", timedelta(days=age_days, minutes=1))
    now = timezone.now()
    for request_id, age_days in (("recent", 2), ("month-old", 29), ("ancient", 31)):
        Feedback.objects.create(
            tenant=world.a,
            request_id=request_id,
            label=1,
            received_at=now - timedelta(days=age_days),
        )
    # Tenant B has no model: its feedback is kept for the default retention (30 days).
    Feedback.objects.create(
        tenant=world.b, request_id="b-old", label=0, received_at=now - timedelta(days=31)
    )
    Feedback.objects.create(tenant=world.b, request_id="b-new", label=0, received_at=now)

    # Whole hour partitions: short's 2-day-old hour and 40-day-old hour, long's 40-day-old one.
    assert purge_expired_logs() == {"log_partitions": 2 + 1, "feedback": 2}
    left = sorted(r["request_id"] for r in logged_rows())
    assert left == ["long-0", "long-2", "long-2", "long-2", "short-0"]
    assert sorted(Feedback.objects.values_list("request_id", flat=True)) == [
        "b-new",
        "month-old",
        "recent",
    ]
    assert purge_prediction_logs() == {"log_partitions": 0, "feedback": 0}  # the beat task


def test_retention_keeps_an_hour_until_its_newest_row_has_expired(world, onnx_bytes):
    model = make_model(world.a, "edge")
    model.log_retention_days = 1
    model.save()
    route = route_of(make_version(model, onnx_bytes))
    now = timezone.now()
    cutoff = now - timedelta(days=1)
    hour = cutoff.replace(minute=0, second=0, microsecond=0)
    # One row past the retention, one in the same hour still inside it.
    make_log(route, "expired", now - hour)
    make_log(route, "kept", now - (cutoff + (hour + timedelta(hours=1) - cutoff) / 2))
    assert purge_expired_logs(now)["log_partitions"] == 0
    assert sorted(r["request_id"] for r in logged_rows()) == ["expired", "kept"]
    assert purge_expired_logs(now + timedelta(hours=1))["log_partitions"] == 1
    assert logged_rows() == []
