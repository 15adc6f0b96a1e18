"""An install upgraded from the prediction log in the database keeps every logged row: the
migration moves them to the Parquet log (inputs, outputs, scores and ids as they were), the
pages read them there, a rerun after an interruption writes nothing twice, and undoing it puts
them back in the table."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from monitoring.quality import logged_predictions
from registry.models import Model
from tests.factories import logged_rows, make_model, make_version

pytestmark = pytest.mark.backends

BEFORE = [("monitoring", "0006_not_ready_requests")]
MIGRATION = [("monitoring", "0007_prediction_log_on_parquet")]


def old_rows(apps, version, n: int) -> None:
    """``n`` rows made through the old model, the way the gateway wrote them."""
    PredictionLog = apps.get_model("monitoring", "PredictionLog")
    now = timezone.now()
    PredictionLog.objects.bulk_create(
        [
            PredictionLog(
                tenant_id=version.model.tenant_id,
                model_id=version.model_id,
                version_id=version.pk,
                arm="candidate" if i % 2 else "",
                request_id=f"old-{i}",
                trace_id="ab" * 16,
                inputs={"age": [30 + i, 31 + i], "plan": ["pro", "free"]},
                outputs={"y": [[0.2, 0.8], [0.6, 0.4]]},
                scores=[0.8, 0.4],
                latency_ms=1.5,
                status=200 if i % 3 else 503,
                created_at=now - timedelta(hours=i),
            )
            for i in range(n)
        ]
    )


@pytest.mark.django_db(transaction=True)
def test_rows_logged_before_the_upgrade_move_to_the_parquet_log(world, onnx_bytes, monkeypatch):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(BEFORE)
    executor.loader.build_graph()
    apps = executor.loader.project_state(BEFORE).apps
    monkeypatch.setattr(
        "monitoring.migrations.0007_prediction_log_on_parquet.CHUNK", 4, raising=False
    )
    old_rows(apps, version, 10)

    executor.migrate(latest)
    executor.loader.build_graph()
    with connection.cursor() as cursor:
        assert "gateway_predictionlog" not in connection.introspection.table_names(cursor)
    rows = logged_rows(world.a.pk)
    assert sorted(r["request_id"] for r in rows) == sorted(f"old-{i}" for i in range(10))
    three = next(r for r in rows if r["request_id"] == "old-3")
    assert three["inputs"] == {"age": [33.0, 34.0], "plan": ["pro", "free"]}
    assert three["outputs"] == {"y": [[0.2, 0.8], [0.6, 0.4]]}
    assert (three["scores"], three["status"], three["arm"]) == ([0.8, 0.4], 503, "candidate")
    assert three["trace_id"] == "ab" * 16 and three["rows"] == 2
    model = Model.objects.get(pk=version.model_id)
    page = logged_predictions(model)
    assert page.count() == 10 and page.page(0, 1)[0].request_id == "old-0"

    # Undone: the rows move back into the table; done again: they are exported once more.
    executor.migrate(BEFORE)
    executor.loader.build_graph()
    apps = executor.loader.project_state(BEFORE).apps
    assert apps.get_model("monitoring", "PredictionLog").objects.count() == 10
    assert logged_rows(world.a.pk) == []
    executor.migrate(latest)
    executor.loader.build_graph()
    assert len(logged_rows(world.a.pk)) == 10


@pytest.mark.django_db(transaction=True)
def test_an_interrupted_migration_run_again_writes_no_row_twice(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(BEFORE)
    executor.loader.build_graph()
    apps = executor.loader.project_state(BEFORE).apps
    old_rows(apps, version, 6)
    migration = executor.loader.get_migration("monitoring", "0007_prediction_log_on_parquet")
    export = migration.operations[0].code
    # The first run wrote the files and then failed before the table was dropped.
    with connection.schema_editor() as editor:
        export(apps, editor)
    executor.migrate(latest)
    executor.loader.build_graph()
    assert sorted(r["request_id"] for r in logged_rows()) == sorted(f"old-{i}" for i in range(6))
