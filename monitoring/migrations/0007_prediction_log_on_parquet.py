"""The prediction log leaves the database: every row of gateway_predictionlog is written to the
Parquet log (``monitoring.logstore``, the "predictions" dataset) in chunks, then the table is
dropped. Undone, the table comes back and the Parquet rows move into it (each file is deleted
once its rows are in the table, so doing it again exports them once more, not twice).

A chunk's files are named by its first row id, so a migration interrupted and run again writes
the same files again (replacing them) instead of logging those rows twice; the table is only
dropped once every chunk is written.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

CHUNK = 5000
FIELDS = (
    "id",
    "tenant_id",
    "model_id",
    "version_id",
    "arm",
    "request_id",
    "trace_id",
    "inputs",
    "outputs",
    "scores",
    "latency_ms",
    "status",
    "created_at",
)


def export_rows(apps: Any, schema_editor: Any) -> None:
    from monitoring.logstore import log_store
    from monitoring.prediction_log import PREDICTIONS, records_table

    PredictionLog = apps.get_model("monitoring", "PredictionLog")
    store = log_store()
    rows = PredictionLog.objects.using(schema_editor.connection.alias).order_by("pk")
    after = 0
    while True:
        chunk = list(rows.filter(pk__gt=after).values(*FIELDS)[:CHUNK])
        if not chunk:
            return
        after = chunk[-1]["id"]
        for record in chunk:
            for name in ("inputs", "outputs"):
                if not isinstance(record[name], dict):
                    record[name] = {}
            if not isinstance(record["scores"], list):
                record["scores"] = []
        table = records_table(chunk)
        for piece in store.split(PREDICTIONS, table, name=f"migrated-{chunk[0]['id']}.parquet"):
            store.put(piece)


def import_rows(apps: Any, schema_editor: Any) -> None:
    from monitoring.logstore import log_store
    from monitoring.prediction_log import PREDICTIONS, log_rows

    PredictionLog = apps.get_model("monitoring", "PredictionLog")
    ModelVersion = apps.get_model("registry", "ModelVersion")
    versions = set(ModelVersion.objects.values_list("pk", flat=True))
    store = log_store()
    for tenant_id in store.tenants(PREDICTIONS):
        for path in store.files(PREDICTIONS, tenant_id):
            table = store.query(PREDICTIONS, [path], "SELECT * FROM log")
            PredictionLog.objects.bulk_create(
                [
                    PredictionLog(**{k: r[k] for k in FIELDS if k != "id"})
                    for r in log_rows(table)
                    if r["version_id"] in versions
                ],
                batch_size=1000,
            )
            store.fs.delete_file(path)


class Migration(migrations.Migration):
    dependencies = [
        ("monitoring", "0006_not_ready_requests"),
        ("registry", "0001_initial"),
    ]

    operations = [
        migrations.RunPython(export_rows, import_rows, elidable=False),
        migrations.DeleteModel(name="PredictionLog"),
    ]
