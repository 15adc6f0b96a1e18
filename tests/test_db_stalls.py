"""The data path when the database stalls: a lookup it does not answer fails only its own
request (503 + Retry-After, the protocol's error shape); an agent socket's writes wait off its
receive path; the gateway's calls run on a pool of threads with lock and statement timeouts;
``/v2/health/ready`` says what the process can serve. The end-to-end version (a control-plane
table locked for 15 s under load) is ``tests/e2e/test_db_stall.py``."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.db import OperationalError, connection, connections

from gateway import consumers, db, oip
from gateway import state as state_module
from gateway.consumers import SessionWrites
from gateway.state import GatewayState

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


@pytest.fixture
def state(monkeypatch) -> GatewayState:
    gateway = GatewayState()
    monkeypatch.setattr(oip, "get_state", lambda: gateway)
    return gateway


def call(path: str, key: str = "", method: str = "POST") -> tuple[int, dict, dict]:
    async def scenario():
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        body = json.dumps(BODY).encode() if method == "POST" else b""
        communicator = HttpCommunicator(oip.oip_app, method, path, body=body, headers=headers)
        return await communicator.get_response(timeout=10)

    response = async_to_sync(scenario)()
    headers = {k.decode().lower(): v.decode() for k, v in response["headers"]}
    return response["status"], headers, json.loads(response["body"])


def test_a_key_lookup_the_database_does_not_answer_is_503_with_retry_after(state, monkeypatch):
    def stuck(raw_key):
        raise OperationalError("canceling statement due to lock timeout")

    monkeypatch.setattr(state_module, "identify_key", stuck)
    status, headers, body = call("/v2/models/clf/infer", "sy_not_cached")
    assert status == 503 and headers["retry-after"] == "1"
    assert "database did not answer" in body["error"]


@pytest.mark.django_db
def test_a_route_lookup_the_database_does_not_answer_is_503_and_not_cached(
    world, state, monkeypatch
):
    def stuck(*args):
        raise OperationalError("canceling statement due to statement timeout")

    monkeypatch.setattr(state_module, "resolve_route", stuck)
    status, headers, body = call("/v2/models/clf/infer", world.key_a)
    assert status == 503 and headers["retry-after"] == "1"
    assert not state._routes  # the next request asks the database again
    monkeypatch.undo()
    monkeypatch.setattr(oip, "get_state", lambda: state)
    status, _, body = call("/v2/models/clf/infer", world.key_a)
    assert status == 404 and "clf" in body["error"]


def test_ready_needs_a_first_refresh_then_the_database_or_a_ready_agent(state, monkeypatch):
    assert call("/v2/health/ready", method="GET")[:1] == (503,)
    assert call("/v2/health/live", method="GET")[0] == 200
    state.refreshed_at = time.monotonic()
    assert call("/v2/health/ready", method="GET")[0] == 200
    # The database has not answered for a while and nothing is ready: nothing can be served.
    state.refreshed_at = time.monotonic() - state_module.READY_STALE_S - 1
    assert call("/v2/health/ready", method="GET")[0] == 503
    # An agent ready here: cached keys and routes are still served.
    monkeypatch.setattr(state.pool, "any_ready", lambda: True)
    assert call("/v2/health/ready", method="GET")[0] == 200


# db_call closes the thread's stale connections around each call, which pytest-django allows
# only in a database test (it failed when an earlier test had left this thread a connection).
@pytest.mark.django_db
def test_session_writes_keep_order_coalesce_heartbeats_and_retry_state_changes(monkeypatch):
    monkeypatch.setattr(consumers, "WRITE_RETRY_S", 0.01)
    made: list[tuple[str, int]] = []
    failures = {"state": 2}

    def heartbeat(n):
        made.append(("heartbeat", n))

    def state_change(n):
        if failures["state"]:
            failures["state"] -= 1
            raise OperationalError("lock timeout")
        made.append(("state", n))

    async def scenario():
        writes = SessionWrites("node-1")
        for n in range(5):
            writes.heartbeat(heartbeat, n)
        writes.put(state_change, 1)
        writes.put(state_change, 2)
        await writes.flushed()

    async_to_sync(scenario)()
    # The state changes in order, each made once despite two failures; of the five
    # heartbeats only the latest was written.
    assert [m for m in made if m[0] == "state"] == [("state", 1), ("state", 2)]
    assert [m for m in made if m[0] == "heartbeat"] == [("heartbeat", 4)]


def test_the_receive_path_does_not_wait_for_a_write():
    release = threading.Event()

    def slow_write():
        release.wait(5)

    async def scenario():
        writes = SessionWrites("node-1")
        started = time.monotonic()
        writes.heartbeat(slow_write)
        queued = time.monotonic() - started
        await asyncio.sleep(0.05)
        release.set()
        await writes.flushed()
        return queued

    assert async_to_sync(scenario)() < 0.01


@pytest.mark.db_threads
@pytest.mark.django_db(transaction=True)
def test_gateway_calls_run_on_a_pool_with_lock_and_statement_timeouts(settings, monkeypatch):
    # Each call's connection is closed after it, so none outlives the test database.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    settings.SWITCHYARD_DB_LOCK_TIMEOUT_MS = 1234
    settings.SWITCHYARD_DB_STATEMENT_TIMEOUT_MS = 4321

    def where() -> tuple[str, list[str]]:
        name = threading.current_thread().name
        if connection.vendor != "postgresql":
            return name, []
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
            )
            return name, list(cursor.fetchone())

    async def scenario():
        return await asyncio.gather(*(db.db_call(where)() for _ in range(4)))

    results = async_to_sync(scenario)()
    for name, timeouts in results:
        assert name.startswith(db.THREAD_PREFIX)
        if connection.vendor == "postgresql":
            assert timeouts == ["1234ms", "4321ms"]
