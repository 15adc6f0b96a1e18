"""The database triggers that refuse UPDATE and DELETE on the audit table (migration 0010
creates them; ``flush`` on SQLite lifts them for the flush alone)."""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper

TABLE = "rollouts_auditevent"
MESSAGE = "audit events are append-only"

_POSTGRES_UP = f"""
CREATE OR REPLACE FUNCTION switchyard_audit_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION '{MESSAGE}' USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
CREATE TRIGGER switchyard_audit_append_only BEFORE UPDATE OR DELETE ON {TABLE}
    FOR EACH ROW EXECUTE FUNCTION switchyard_audit_append_only();
"""
_POSTGRES_DOWN = f"""
DROP TRIGGER IF EXISTS switchyard_audit_append_only ON {TABLE};
DROP FUNCTION IF EXISTS switchyard_audit_append_only();
"""
_SQLITE_UP = [
    f"CREATE TRIGGER IF NOT EXISTS switchyard_audit_no_{verb.lower()} BEFORE {verb} ON {TABLE} "
    f"BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END"
    for verb in ("UPDATE", "DELETE")
]
_SQLITE_DOWN = [f"DROP TRIGGER IF EXISTS switchyard_audit_no_{v}" for v in ("update", "delete")]


def trigger_sql(vendor: str, up: bool) -> list[str]:
    """The statements that create (``up``) or drop the triggers on this database vendor; none
    on another vendor (the model and queryset guards still hold there)."""
    if vendor == "postgresql":
        return [_POSTGRES_UP if up else _POSTGRES_DOWN]
    if vendor == "sqlite":
        return _SQLITE_UP if up else _SQLITE_DOWN
    return []


def set_triggers(connection: BaseDatabaseWrapper, up: bool) -> None:
    with connection.cursor() as cursor:
        for sql in trigger_sql(connection.vendor, up):
            cursor.execute(sql)
