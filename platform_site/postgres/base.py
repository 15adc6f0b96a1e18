"""The backend's connection wrapper: Django's, with each connect guarded by the circuit of its
database (``platform_site.postgres``)."""

from __future__ import annotations

from typing import Any

import psycopg
from django.db.backends.postgresql import base

from . import DatabaseUnavailable, circuit


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        breaker = circuit(self.alias)
        if not breaker.claim():
            raise DatabaseUnavailable(breaker.retry_after())
        try:
            connection = super().get_new_connection(conn_params)
        except psycopg.OperationalError as exc:  # refused, timed out, too many clients
            breaker.failed(exc)
            raise DatabaseUnavailable(breaker.retry_after()) from exc
        breaker.succeeded()
        return connection
