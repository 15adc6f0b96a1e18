"""An install upgraded to alias history gets its aliases' past moves from the audit log, so a
one-click rollback works at once instead of answering 409 until the alias moves again."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.backends

BEFORE = [("registry", "0006_alias_history")]
AFTER = [("registry", "0007_alias_history_backfill")]
TENANTS = ("tenants", "0010_audit_append_only_triggers")


def make_versions(apps, tenant, name: str, count: int):
    model = apps.get_model("registry", "Model").objects.create(
        tenant=tenant, name=name, task="classifier"
    )
    versions = [
        apps.get_model("registry", "ModelVersion").objects.create(
            model=model,
            version=n,
            artifact=f"artifacts/{name}/{n}.onnx",
            sha256=f"{n:02x}" * 32,
            format="onnx",
            inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            outputs=[{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        )
        for n in range(1, count + 1)
    ]
    return model, versions


def moved(apps, tenant, model, alias: str, before: int | None, after: int, who: str) -> None:
    apps.get_model("tenants", "AuditEvent").objects.create(
        tenant=tenant,
        tenant_slug=tenant.slug,
        actor_label=who,
        action="alias.move",
        target=f"{tenant.slug}/{model.name}@{alias}",
        before={} if before is None else {"version": before},
        after={"version": after},
        reason=f"to v{after}",
    )


@pytest.mark.django_db(transaction=True)
def test_past_moves_become_the_alias_history_and_a_rollback_can_go_back_at_once():
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    executor.loader.build_graph()
    # The state as the backfill sees it: registry before it, tenants at their latest.
    apps = executor.loader.project_state([*BEFORE, TENANTS]).apps
    tenant = apps.get_model("tenants", "Tenant").objects.create(name="Acme", slug="acme")
    other = apps.get_model("tenants", "Tenant").objects.create(name="Other", slug="other")
    Alias = apps.get_model("registry", "Alias")
    fraud, (v1, v2, v3) = make_versions(apps, tenant, "fraud", 3)
    moved(apps, tenant, fraud, "production", None, 1, "admin")
    moved(apps, tenant, fraud, "production", 1, 2, "ann")
    moved(apps, tenant, fraud, "production", 2, 3, "bob")
    moved(apps, tenant, fraud, "staging", None, 2, "ann")
    Alias.objects.create(model=fraud, name="production", version=v3)
    Alias.objects.create(model=fraud, name="staging", version=v3)  # moved unaudited to v3
    # Another tenant's events with a look-alike target never join this history.
    moved(apps, other, fraud, "production", 3, 1, "mallory")
    churn, (c1,) = make_versions(apps, tenant, "churn", 1)
    Alias.objects.create(model=churn, name="production", version=c1)  # no event at all

    executor.migrate(AFTER)
    executor.loader.build_graph()
    # Then every later migration, so the current models below match the tables (and the
    # tests after this one find the schema they expect).
    executor.migrate(executor.loader.graph.leaf_nodes())
    executor.loader.build_graph()

    from registry.models import AliasChange, Model
    from rollouts.rollback import rollback_alias
    from tenants.audit import Actor

    def history(model_name: str, alias: str) -> list[tuple[int | None, int, str]]:
        rows = AliasChange.objects.filter(model__name=model_name, alias=alias).order_by("at", "pk")
        return [
            (
                c.from_version.version if c.from_version else None,
                c.to_version.version,
                c.actor_label,
            )
            for c in rows.select_related("from_version", "to_version")
        ]

    assert history("fraud", "production") == [(None, 1, "admin"), (1, 2, "ann"), (2, 3, "bob")]
    assert history("fraud", "staging") == [(None, 2, "ann"), (2, 3, "unknown")]
    assert history("churn", "production") == [(None, 1, "unknown")]
    # The history ends where the alias points, so the default rollback goes one move back.
    model = Model.objects.get(name="fraud")
    rollback_alias(model, "production", Actor(None, "oncall"), reason="upgrade drill")
    assert model.aliases.get(name="production").version.version == 2
