"""Django's PostgreSQL backend, except that a process stops connecting while the database
cannot be reached (``ENGINE = "platform_site.postgres"``, which the settings set for
PostgreSQL; the backend itself is ``base.DatabaseWrapper``, where Django looks for it).

Without it every request during an outage made its own connect attempt, each waiting up to
``connect_timeout`` when the server does not answer, and answered 500. Here the first connect
that fails opens the process's circuit of that database for ``SWITCHYARD_DB_RETRY_S``: until
then a connect raises ``DatabaseUnavailable`` at once, which every protocol answers with 503
and ``Retry-After`` (``platform_site.db_outage``). Then one connect probes the server while the
others still fail fast, and its success closes the circuit. Only connecting counts: a query
that fails on an open connection (a lock timeout, say) says nothing of whether the server can
be reached.
"""

from __future__ import annotations

from django.conf import settings
from django.db import OperationalError

from platform_site.breakers import SharedBreaker


class DatabaseUnavailable(OperationalError):
    """The database cannot be reached: a connect failed, or the circuit is open and nothing
    was tried. Every protocol answers 503 with ``Retry-After``, the seconds until the process
    tries the database again. An ``OperationalError``, so the code that copes with one (the
    data path's 503, the prediction log's retries) copes with this one."""

    def __init__(self, retry_after_s: int) -> None:
        # The answer says nothing of the server (its address is in the log, not in answers).
        super().__init__(f"the platform's database is unreachable; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


_circuits: dict[str, SharedBreaker] = {}


def circuit(alias: str) -> SharedBreaker:
    """The circuit of the database ``alias`` names, one per process (its threads share it)."""
    found = _circuits.get(alias)
    if found is None:
        made = SharedBreaker(f"the database {alias!r}", settings.SWITCHYARD_DB_RETRY_S)
        found = _circuits.setdefault(alias, made)
    return found
