"""Database calls from the gateway, on threads of their own.

Channels' ``database_sync_to_async`` runs every call on one shared thread, so one query stuck
behind a lock (a cache miss while an operator holds a control-plane table) made every other
database call of the process wait behind it: the agent sockets' heartbeat writes, and with them
the replies of every request (measured: 504s and 10 s medians while ``tenants_tenant`` was
locked). Here each call runs on a pool of ``SWITCHYARD_DB_THREADS`` threads, each with its own
connection, and on PostgreSQL those connections carry ``lock_timeout`` and
``statement_timeout``: a stuck query fails (the request that needed it answers 503) instead
of holding a thread for as long as the lock lasts. ``SWITCHYARD_DB_THREADS=0`` keeps the one
shared thread (the unit tests' default: their rows live in the test's transaction, which only
the test's own thread sees).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

P = ParamSpec("P")
R = TypeVar("R")

THREAD_PREFIX = "switchyard-db"
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def db_call(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """``fn`` as a coroutine function run on the gateway's database threads (made once per
    function: building asgiref's wrapper on every call was a tenth of the refresh loop's CPU
    at rest, bench/idle_bench.py)."""
    key = (fn, settings.SWITCHYARD_DB_THREADS)
    found = _wrapped.get(key)
    if found is None:
        found = _wrapped[key] = _wrap(fn)
    return found


_wrapped: dict[tuple[Callable[..., Any], int], Callable[..., Awaitable[Any]]] = {}


def _wrap(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    if settings.SWITCHYARD_DB_THREADS <= 0:
        return database_sync_to_async(fn)

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        # As Channels does: connections past their CONN_MAX_AGE or broken are replaced.
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(call, thread_sensitive=False, executor=_pool())


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = ThreadPoolExecutor(
                    settings.SWITCHYARD_DB_THREADS, thread_name_prefix=THREAD_PREFIX
                )
    return _executor


def set_timeouts(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """Bound how long a gateway thread's query may wait for a lock or run (PostgreSQL); the
    other processes (Celery, migrations) keep the server's defaults."""
    if connection.vendor != "postgresql":
        return
    if not threading.current_thread().name.startswith(THREAD_PREFIX):
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('lock_timeout', %s, false), "
            "set_config('statement_timeout', %s, false)",
            [
                f"{settings.SWITCHYARD_DB_LOCK_TIMEOUT_MS}ms",
                f"{settings.SWITCHYARD_DB_STATEMENT_TIMEOUT_MS}ms",
            ],
        )


connection_created.connect(set_timeouts, dispatch_uid="gateway.db.set_timeouts")


def database_stamp() -> tuple[int, ...] | None:
    """On SQLite, a stamp that moves with every commit by any process: the inode, size and
    modification time of the database file and of its write-ahead log (a commit appends to
    the log, a checkpoint rewrites both), read with two ``stat`` calls. While it stands still
    nothing was written, and the gateway's refresh need not ask the database (at rest that
    was most of the web process's CPU: bench/idle_bench.py). None elsewhere, and where the
    database calls share the test's thread (``SWITCHYARD_DB_THREADS=0``: a test's rows are
    in its uncommitted transaction, which no file shows)."""
    database = settings.DATABASES["default"]
    if database["ENGINE"] != "django.db.backends.sqlite3" or settings.SWITCHYARD_DB_THREADS <= 0:
        return None
    return sqlite_stamp(str(database["NAME"]))


def sqlite_stamp(name: str) -> tuple[int, ...]:
    """``database_stamp`` of the SQLite database file ``name``."""
    stamp: list[int] = []
    for path in (name, f"{name}-wal"):
        try:
            found = os.stat(path)
        except FileNotFoundError:
            stamp += (0, 0, 0)
            continue
        stamp += (found.st_ino, found.st_size, found.st_mtime_ns)
    return tuple(stamp)
