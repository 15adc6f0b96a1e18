"""A database made before the apps were split (the layout of 2026-11-24: gateway, registry,
rollouts, tenants) migrates to the current layout keeping every row: moved models keep their
tables, and their content types (permissions, admin history) follow them to the new app."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

pytestmark = pytest.mark.backends

# The last migration of each app before the split; the new apps did not exist.
OLD_LAYOUT = [
    ("tenants", "0004_observability"),
    ("registry", "0003_observability"),
    ("rollouts", "0007_observability"),
    ("gateway", "0004_observability"),
    ("contenttypes", "0002_remove_content_type_name"),
]
# Migrating to it also takes back every migration of the apps the split made.
OLD_TARGETS = [*OLD_LAYOUT, ("monitoring", None), ("fleet", None)]
# Where each moved table's model lived, and where it lives now.
MOVED = {
    "rollouts_auditevent": ("rollouts", "tenants", "auditevent"),
    "rollouts_referencesample": ("rollouts", "registry", "referencesample"),
    "gateway_trafficsample": ("gateway", "monitoring", "trafficsample"),
    "gateway_predictionlog": ("gateway", "monitoring", "predictionlog"),
    "gateway_feedback": ("gateway", "monitoring", "feedback"),
    "rollouts_driftreport": ("rollouts", "monitoring", "driftreport"),
    "rollouts_alert": ("rollouts", "monitoring", "alert"),
    "gateway_node": ("gateway", "fleet", "node"),
    "gateway_agentsession": ("gateway", "fleet", "agentsession"),
    "gateway_configgeneration": ("gateway", "fleet", "configgeneration"),
    "rollouts_pool": ("rollouts", "fleet", "pool"),
    "rollouts_deployment": ("rollouts", "fleet", "deployment"),
    "rollouts_scalingdecision": ("rollouts", "fleet", "scalingdecision"),
}


def fill_old_layout(apps) -> None:
    """One row in every table the split moves, made through the old layout's models."""
    now = timezone.now()
    tenant = apps.get_model("tenants", "Tenant").objects.create(name="Acme", slug="acme")
    model = apps.get_model("registry", "Model").objects.create(
        tenant=tenant, name="fraud", task="classifier"
    )
    version = apps.get_model("registry", "ModelVersion").objects.create(
        model=model,
        version=1,
        artifact="artifacts/1/abc.onnx",
        sha256="ab" * 32,
        format="onnx",
        inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
    )
    rollouts = {name: apps.get_model("rollouts", name) for name in MODELS_IN["rollouts"]}
    gateway = {name: apps.get_model("gateway", name) for name in MODELS_IN["gateway"]}
    rollouts["AuditEvent"].objects.create(
        tenant=tenant, actor_label="system", action="key.create", target="api key"
    )
    rollouts["ReferenceSample"].objects.create(
        version=version, source="upload", columns={"x[0]": [1.0]}, rows=1
    )
    rollouts["DriftReport"].objects.create(
        tenant=tenant,
        model=model,
        version=version,
        window_start=now,
        window_end=now,
        reference_source="upload",
        rows_current=30,
        rows_reference=30,
        threshold=0.2,
    )
    rollouts["Alert"].objects.create(
        tenant=tenant, kind="drift", severity="warning", key="drift:1", title="t", message="m"
    )
    pool = rollouts["Pool"].objects.create(name="local", backend="local")
    deployment = rollouts["Deployment"].objects.create(tenant=tenant, version=version, pool=pool)
    rollouts["ScalingDecision"].objects.create(
        deployment=deployment, current=0, desired=1, reason="up"
    )
    gateway["TrafficSample"].objects.create(
        version=version, window_end=now, requests=3, errors=0, latency_buckets=[3]
    )
    gateway["PredictionLog"].objects.create(
        tenant=tenant,
        model=model,
        version=version,
        request_id="r1",
        latency_ms=1.0,
        status=200,
        created_at=now,
    )
    gateway["Feedback"].objects.create(tenant=tenant, request_id="r1", label=1, received_at=now)
    node = gateway["Node"].objects.create(name="gpu-1", token_prefix="ab12", token_hash="0" * 64)
    gateway["AgentSession"].objects.create(node=node, channel_name="c1", deployment=deployment)
    gateway["ConfigGeneration"].objects.create(pk=1, value=7)
    content_types = apps.get_model("contenttypes", "ContentType").objects
    for old_app, _, name in MOVED.values():
        content_types.get_or_create(app_label=old_app, model=name)


MODELS_IN = {
    "rollouts": [
        "AuditEvent",
        "ReferenceSample",
        "DriftReport",
        "Alert",
        "Pool",
        "Deployment",
        "ScalingDecision",
    ],
    "gateway": [
        "TrafficSample",
        "PredictionLog",
        "Feedback",
        "Node",
        "AgentSession",
        "ConfigGeneration",
    ],
}


def row_counts() -> dict[str, int]:
    with connection.cursor() as cursor:
        tables = connection.introspection.table_names(cursor)
        counts = {}
        for table in tables:
            if table in ("django_migrations", "django_content_type"):
                continue
            cursor.execute(f'SELECT COUNT(*) FROM "{table}"')
            counts[table] = cursor.fetchone()[0]
    return counts


@pytest.mark.django_db(transaction=True)
def test_a_database_of_the_old_layout_keeps_every_row_and_its_content_types():
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(OLD_TARGETS)
    executor.loader.build_graph()
    fill_old_layout(executor.loader.project_state(OLD_LAYOUT).apps)
    before = row_counts()
    assert all(before[table] == 1 for table in MOVED), before

    executor.migrate(latest)
    executor.loader.build_graph()

    after = row_counts()
    # No table of the old layout was dropped, emptied or filled, but the prediction log's,
    # whose rows moved to the Parquet log; tables that later migrations add (after the layout
    # change) start empty.
    kept = {table: n for table, n in before.items() if table != "gateway_predictionlog"}
    assert {table: after.get(table) for table in kept} == kept
    assert "gateway_predictionlog" not in after
    assert all(after[table] == 0 for table in set(after) - set(before)), after
    from django.contrib.contenttypes.models import ContentType

    for old_app, new_app, name in MOVED.values():
        assert ContentType.objects.filter(app_label=new_app, model=name).count() == 1
        assert not ContentType.objects.filter(app_label=old_app, model=name).exists()
    # The rows read through the new layout's models, relations included.
    from fleet.models import AgentSession, ConfigGeneration
    from monitoring.models import Feedback
    from tenants.models import AuditEvent
    from tests.factories import logged_rows

    session = AgentSession.objects.select_related("node", "deployment__pool").get()
    assert (session.node.name, session.deployment.pool.name) == ("gpu-1", "local")
    assert ConfigGeneration.objects.get().value == 7
    (logged,) = logged_rows()
    assert (logged["request_id"], logged["model_id"]) == ("r1", session.deployment.version.model_id)
    assert Feedback.objects.get().request_id == "r1"
    assert AuditEvent.objects.get().tenant.slug == "acme"


@pytest.mark.django_db(transaction=True)
def test_the_split_can_be_undone_keeping_the_rows():
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(OLD_TARGETS)
    executor.loader.build_graph()
    fill_old_layout(executor.loader.project_state(OLD_LAYOUT).apps)
    executor.migrate(latest)
    executor.loader.build_graph()
    after_split = row_counts()

    executor.migrate(OLD_TARGETS)
    executor.loader.build_graph()
    undone = row_counts()
    # Tables added after the layout change are dropped when it is undone; the rest keep every
    # row, and the prediction log's table is back with its row from the Parquet log.
    assert undone.pop("gateway_predictionlog") == 1
    assert undone == {table: after_split[table] for table in undone}
    apps = executor.loader.project_state(OLD_LAYOUT).apps
    assert apps.get_model("gateway", "Node").objects.get().name == "gpu-1"
    executor.migrate(latest)
