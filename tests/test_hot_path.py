"""The data path's shared timers and its one write per reply (issue 33, docs/architecture.md
"The cost of one request, stage by stage"): what replaced a timer per request must still
expire what it watches, and a reply written once must still be the same bytes."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from gateway.asgi_io import respond
from gateway.db import sqlite_stamp
from gateway.dispatch import Deadlines, Expired
from gateway.errors import ApiError
from gateway.frontdoor import until_client_leaves
from gateway.http_bounds import BoundedHttpProtocol
from gateway.state import REST_AFTER_S, REST_INTERVAL_S, GatewayState


def test_deadlines_fail_only_the_requests_past_their_time() -> None:
    async def scenario() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines()
        slow, fast, answered = (loop.create_future() for _ in range(3))
        deadlines.add(slow, 0.5)
        deadlines.add(fast, 0.05)  # a shorter budget after a longer one moves the one timer
        entry = deadlines.add(answered, 0.05)
        answered.set_result("reply")
        entry[2] = None  # its waiter stopped waiting: the heap lets go of it
        await asyncio.sleep(0.15)
        states = [
            "expired" if f.done() and isinstance(f.exception(), Expired) else "waiting"
            for f in (slow, fast)
        ]
        await asyncio.sleep(0.5)
        states.append("expired" if isinstance(slow.exception(), Expired) else "waiting")
        return states, len(deadlines._heap)

    states, left = asyncio.run(scenario())
    assert states == ["waiting", "expired", "expired"]
    assert left == 0  # nothing kept once every deadline passed


class Transport(asyncio.Transport):
    """A connection's transport that keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


async def whole(scope: Any, receive: Any, send: Any) -> None:
    await respond(send, 200, b'{"ok":true}', [])


async def streamed(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await asyncio.sleep(0.05)  # the first chunk comes later: the head must not wait for it
    await send({"type": "http.response.body", "body": b"a", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def serve(
    app: Any, request: bytes, wait: float = 0.02, linger: float = 0.2
) -> tuple[list[bytes], list[bytes]]:
    """The writes of one request served by the production protocol class: those made by
    ``wait`` seconds after the request arrived, and all of them."""

    async def scenario() -> tuple[list[bytes], list[bytes]]:
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False)
        config.load()
        protocol = BoundedHttpProtocol(
            config=config, server_state=ServerState(), app_state={}, _loop=None
        )
        transport = Transport()
        protocol.connection_made(transport)
        protocol.data_received(request)
        await asyncio.sleep(wait)
        early = list(transport.writes)
        await asyncio.sleep(linger)
        protocol.connection_lost(None)
        await asyncio.sleep(0.01)  # the request's task sees a hang-up
        return early, transport.writes

    return asyncio.run(scenario())


def test_a_whole_reply_goes_out_in_one_write() -> None:
    _, writes = serve(whole, b"POST /v2 HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    assert len(writes) == 1
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-length: 11" in head and body == b'{"ok":true}'


@pytest.mark.parametrize("method", [b"HEAD", b"GET"])
def test_a_head_request_and_a_stream_get_their_head_at_once(method: bytes) -> None:
    app = whole if method == b"HEAD" else streamed
    early, writes = serve(app, method + b" /v2 HTTP/1.1\r\nhost: x\r\n\r\n")
    assert early and early[0].startswith(b"HTTP/1.1 200 OK\r\n")  # not held for a body
    if method == b"HEAD":
        assert writes == early  # no body for a HEAD
    else:
        assert b"".join(writes[1:]) == b"1\r\na\r\n0\r\n\r\n"  # chunked, as uvicorn writes it


def test_the_sqlite_stamp_moves_with_each_commit_and_only_then(tmp_path: Path) -> None:
    name = str(tmp_path / "db.sqlite3")
    writer = sqlite3.connect(name)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("CREATE TABLE t (x INTEGER)")
    writer.commit()
    before = sqlite_stamp(name)
    assert sqlite_stamp(name) == before
    reader = sqlite3.connect(name)
    assert reader.execute("SELECT count(*) FROM t").fetchone() == (0,)
    assert sqlite_stamp(name) == before  # reading writes nothing
    writer.execute("INSERT INTO t VALUES (1)")
    writer.commit()
    assert sqlite_stamp(name) != before
    writer.close()
    reader.close()


def test_a_process_at_rest_refreshes_every_second_and_every_half_while_serving() -> None:
    state = GatewayState()
    assert state.refresh_interval() == REST_INTERVAL_S  # never served
    state.served_at = time.perf_counter()
    assert state.refresh_interval() == 0.5
    state.served_at = time.perf_counter() - REST_AFTER_S - 1
    assert state.refresh_interval() == REST_INTERVAL_S


def test_a_hang_up_cancels_the_waiting_request_through_the_protocol_without_a_task() -> None:
    seen: dict[str, Any] = {}

    async def waits(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the body
        work = asyncio.get_running_loop().create_future()
        tasks_before = len(asyncio.all_tasks())

        async def wait_for_agent() -> None:
            await asyncio.sleep(0.1)  # past WATCH_AFTER_S: a watcher task would have started
            seen["tasks"] = len(asyncio.all_tasks()) - tasks_before
            await work

        try:
            await until_client_leaves(receive, wait_for_agent())
        except ApiError as exc:
            seen["status"], seen["at"] = exc.status, time.monotonic()

    hung_up = time.monotonic()
    serve(waits, b"POST /v2 HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}", linger=0.15)
    assert seen["tasks"] == 0  # the protocol watches the connection: no task of its own
    assert seen["status"] == 499
    assert seen["at"] - hung_up >= 0.15  # at the hang-up (connection_lost), not before
