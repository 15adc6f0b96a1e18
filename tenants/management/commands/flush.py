"""Django's ``flush``, which on SQLite lifts the audit table's append-only triggers for the
flush alone (SQLite empties tables with DELETE, which they refuse; PostgreSQL's TRUNCATE does
not fire them). Emptying the whole database is the one deliberate way to drop audit rows."""

from typing import Any

from django.core.management.commands import flush
from django.db import DEFAULT_DB_ALIAS, connections

from tenants.append_only import set_triggers


class Command(flush.Command):
    def handle(self, **options: Any) -> None:
        connection = connections[options.get("database") or DEFAULT_DB_ALIAS]
        if connection.vendor != "sqlite":
            super().handle(**options)
            return
        set_triggers(connection, up=False)
        try:
            super().handle(**options)
        finally:
            set_triggers(connection, up=True)
