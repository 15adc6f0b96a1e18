"""This process's servers beside the ASGI one (``platform_site.asgi.ProcessServers``): started
by the ASGI lifespan where the server sends one (uvicorn), else by the first scope of any type
(daphne sends no lifespan events), once, without delaying or failing that request; a failed
start is logged and tried again by a later scope. Daphne itself: tests/e2e/test_grpc_e2e.py."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.testing import ApplicationCommunicator, HttpCommunicator
from django.db import connections
from tritonclient.grpc import aio as triton_aio

from gateway import grpc_server
from platform_site import asgi
from tests.e2e.harness import free_port

# get_state() (its refresh loop reads the route table) runs as the gRPC server starts.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.db_threads]


@pytest.fixture
def servers(settings: Any, monkeypatch: pytest.MonkeyPatch) -> asgi.ProcessServers:
    """A process that has started none yet, with gRPC on a free port of its own."""
    settings.SWITCHYARD_GRPC_HOST = "127.0.0.1"
    settings.SWITCHYARD_GRPC_PORT = free_port()
    # Each gateway database call's connection is closed after it, so none outlives the test
    # database (as in tests/test_grpc_server.py).
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    fresh = asgi.ProcessServers()
    monkeypatch.setattr(asgi, "servers", fresh)
    return fresh


async def get(path: str = "/v2/health/live") -> int:
    reply = await HttpCommunicator(asgi.application, "GET", path).get_response(timeout=10)
    return int(reply["status"])


async def grpc_live(port: int) -> bool:
    async with triton_aio.InferenceServerClient(f"127.0.0.1:{port}") as client:
        return bool(await client.is_server_live())


async def started(servers: asgi.ProcessServers) -> None:
    """Until the start the scopes launched has ended, however it ended."""
    for _ in range(500):
        if servers._starting is None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the start did not end")


def test_without_a_lifespan_the_first_scopes_start_grpc_once(servers: Any, settings: Any) -> None:
    async def scenario() -> tuple[list[int], bool, int]:
        # Several first requests at once: they are answered, and one start runs.
        statuses = await asyncio.gather(*(get() for _ in range(3)))
        await started(servers)
        live, count = await grpc_live(settings.SWITCHYARD_GRPC_PORT), len(grpc_server._servers)
        await servers.stop()  # on this loop, which the server belongs to
        return statuses, live, count

    statuses, live, count = async_to_sync(scenario)()
    assert statuses == [200, 200, 200]
    assert live and count == 1


def test_a_failed_start_is_logged_never_the_requests_and_a_later_scope_retries(
    servers: Any, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    taken = socket.socket()  # the port is another's (no SO_REUSEPORT): gRPC cannot bind it
    taken.bind(("127.0.0.1", settings.SWITCHYARD_GRPC_PORT))
    taken.listen()

    async def scenario() -> tuple[int, int, bool, int, bool]:
        first = await get()
        await started(servers)
        soon = await get()  # within RETRY_S: not tried again, nor logged again
        tried_soon = servers._starting is not None
        taken.close()
        servers._retry_at = 0.0  # RETRY_S later
        later = await get()
        await started(servers)
        live = await grpc_live(settings.SWITCHYARD_GRPC_PORT)
        await servers.stop()
        return first, soon, tried_soon, later, live

    with caplog.at_level(logging.ERROR, logger="platform_site.asgi"):
        first, soon, tried_soon, later, live = async_to_sync(scenario)()
    assert (first, soon, later) == (200, 200, 200)
    failures = [r for r in caplog.records if "could not start the gRPC server" in r.message]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert not tried_soon
    assert live


def test_a_lifespan_startup_starts_them_and_its_shutdown_stops_them(
    servers: Any, settings: Any
) -> None:
    async def scenario() -> tuple[str, bool, int, str, bool]:
        lifespan = ApplicationCommunicator(asgi.application, {"type": "lifespan"})
        await lifespan.send_input({"type": "lifespan.startup"})
        up = (await lifespan.receive_output(10))["type"]
        await get()  # the lifespan's: a scope starts nothing more
        live = await grpc_live(settings.SWITCHYARD_GRPC_PORT)
        count = len(grpc_server._servers)
        await lifespan.send_input({"type": "lifespan.shutdown"})
        down = (await lifespan.receive_output(10))["type"]
        return up, live, count, down, grpc_server.running()

    up, live, count, down, running = async_to_sync(scenario)()
    assert up == "lifespan.startup.complete" and live and count == 1
    assert servers._starting is None and servers.lifespan
    assert down == "lifespan.shutdown.complete" and not running
