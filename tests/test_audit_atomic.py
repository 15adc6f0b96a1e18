"""Every state change writes its audit event in the same transaction: when the database
refuses the audit row (a trigger on the audit table, a real database error), the change it
records is rolled back with it, on PostgreSQL and on SQLite alike."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import DatabaseError, connection

from registry.models import Alias
from registry.services import set_alias
from tenants.keys import create_api_key, revoke_api_key, set_key_priority
from tenants.models import ApiKey, AuditEvent, KeyPriority
from tests.factories import make_model, make_version

pytestmark = pytest.mark.backends

AUDIT_TABLE = AuditEvent._meta.db_table


@pytest.fixture
def audit_refused(db) -> Iterator[None]:
    """From here on the database refuses every new audit row."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE FUNCTION refuse_audit() RETURNS trigger LANGUAGE plpgsql AS"
                " $$ BEGIN RAISE EXCEPTION 'audit refused'; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER refuse_audit BEFORE INSERT ON {AUDIT_TABLE}"
                " FOR EACH ROW EXECUTE FUNCTION refuse_audit()"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER refuse_audit BEFORE INSERT ON {AUDIT_TABLE}"
                " BEGIN SELECT RAISE(ABORT, 'audit refused'); END"
            )
    yield  # the test's transaction is rolled back afterwards, the trigger with it


def test_a_key_whose_audit_row_fails_is_not_created(world, audit_refused):
    before = ApiKey.objects.count()
    with pytest.raises(DatabaseError, match="audit refused"):
        create_api_key(world.a, "unaudited")
    assert ApiKey.objects.count() == before
    assert not ApiKey.objects.filter(name="unaudited").exists()


@pytest.fixture
def key(world) -> ApiKey:
    return create_api_key(world.a, "kept")[0]


def test_a_revocation_whose_audit_row_fails_leaves_the_key_working(key, audit_refused):
    with pytest.raises(DatabaseError, match="audit refused"):
        revoke_api_key(key)
    key.refresh_from_db()
    assert key.revoked_at is None


def test_a_priority_change_whose_audit_row_fails_keeps_the_old_priority(key, audit_refused):
    with pytest.raises(DatabaseError, match="audit refused"):
        set_key_priority(key, KeyPriority.BATCH)
    key.refresh_from_db()
    assert key.priority == KeyPriority.INTERACTIVE


@pytest.fixture
def two_versions(world, onnx_bytes):
    model = make_model(world.a, "clf")
    return model, make_version(model, onnx_bytes), make_version(model, onnx_bytes, alias=None)


def test_an_alias_move_whose_audit_row_fails_leaves_the_alias_where_it_was(
    two_versions, audit_refused
):
    model, v1, v2 = two_versions
    events = AuditEvent.objects.count()
    with pytest.raises(DatabaseError, match="audit refused"):
        set_alias(model, "production", v2)
    assert Alias.objects.get(model=model, name="production").version_id == v1.pk
    with pytest.raises(DatabaseError, match="audit refused"):
        set_alias(model, "staging", v2)  # a new alias is not created either
    assert not Alias.objects.filter(model=model, name="staging").exists()
    assert AuditEvent.objects.count() == events


def test_without_the_failure_the_same_changes_are_made_and_audited(key, two_versions):
    """The control: the same calls succeed and each writes its event."""
    model, _, v2 = two_versions
    revoke_api_key(key)
    set_alias(model, "production", v2)
    actions = set(AuditEvent.objects.values_list("action", flat=True))
    assert {"key.create", "key.revoke", "alias.move"} <= actions
