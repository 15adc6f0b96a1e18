"""The database itself refuses to change or delete an audit event, whatever the code path (raw
SQL, a queryset that bypasses the model, a shell). PostgreSQL's TRUNCATE does not fire row
triggers, so ``manage.py flush`` (and the test suite's teardown) still empties the table there;
on SQLite ``tenants``' own ``flush`` command lifts the triggers for the flush alone."""

from django.db import migrations

from tenants.append_only import trigger_sql


def create(apps, schema_editor):
    for sql in trigger_sql(schema_editor.connection.vendor, up=True):
        schema_editor.execute(sql)


def drop(apps, schema_editor):
    for sql in trigger_sql(schema_editor.connection.vendor, up=False):
        schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0009_key_scopes_expiry_durable_audit"),
    ]

    operations = [migrations.RunPython(create, drop)]
