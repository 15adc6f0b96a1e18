"""Alias history for aliases that moved before it existed, rebuilt from the audit log's
``alias.move`` events, so a rollback right after the upgrade can go where the alias pointed
before. An alias whose last recorded move does not end where it points now (a move the audit
log never saw, e.g. an old admin edit) gets one more row saying so: the history always ends at
the alias's current version, which is what a rollback starts from."""

from django.db import migrations

UNRECORDED = "a move the audit log did not record (before alias history existed)"


def backfill(apps, schema_editor):
    Alias = apps.get_model("registry", "Alias")
    AliasChange = apps.get_model("registry", "AliasChange")
    ModelVersion = apps.get_model("registry", "ModelVersion")
    AuditEvent = apps.get_model("tenants", "AuditEvent")
    User = apps.get_model("auth", "User")
    users = set(User.objects.values_list("pk", flat=True))
    for alias in Alias.objects.select_related("model__tenant").order_by("pk"):
        model = alias.model
        if AliasChange.objects.filter(model_id=model.pk, alias=alias.name).exists():
            continue
        versions = dict(ModelVersion.objects.filter(model_id=model.pk).values_list("version", "pk"))
        events = AuditEvent.objects.filter(
            tenant_id=model.tenant_id,
            action="alias.move",
            target=f"{model.tenant.slug}/{model.name}@{alias.name}",
        ).order_by("created_at", "pk")
        last_to = None
        for event in events:
            to_id = versions.get((event.after or {}).get("version"))
            if to_id is None:
                continue
            change = AliasChange.objects.create(
                model_id=model.pk,
                alias=alias.name,
                from_version_id=versions.get((event.before or {}).get("version")),
                to_version_id=to_id,
                actor_id=event.actor_id if event.actor_id in users else None,
                actor_label=event.actor_label[:200],
                reason=event.reason,
            )
            # ``at`` is set on insert: the move's own time comes from its audit event.
            AliasChange.objects.filter(pk=change.pk).update(at=event.created_at)
            last_to = to_id
        if last_to != alias.version_id:
            change = AliasChange.objects.create(
                model_id=model.pk,
                alias=alias.name,
                from_version_id=last_to,
                to_version_id=alias.version_id,
                actor_label="unknown",
                reason=UNRECORDED,
            )
            AliasChange.objects.filter(pk=change.pk).update(at=alias.updated_at)


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0006_alias_history"),
        ("tenants", "0010_audit_append_only_triggers"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [migrations.RunPython(backfill, migrations.RunPython.noop)]
