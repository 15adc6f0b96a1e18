"""Bounds on reading a request that the ASGI servers do not set on their own: time and size.

uvicorn closes an idle keep-alive connection, but a connection whose request headers never
finish (slowloris), and a request whose body stops arriving, stay open for as long as the
client likes; and Django spools any body to disk, however large, before a view can refuse it.
These bounds answer 408 or 413 and close the connection:

- ``BoundedHttpProtocol``: uvicorn's httptools protocol with a header timeout (from the
  connection's start, or the first byte of a request, to its last header). Run uvicorn with
  ``--http gateway.http_bounds:BoundedHttpProtocol`` (the Procfile, Dockerfile and
  deploy/web.yaml do).
- ``read_within``: a body read that waits at most ``SWITCHYARD_BODY_TIMEOUT_S`` for the next
  piece (nginx's ``client_body_timeout``: the gap between two reads, not the whole body, so a
  large upload on a slow link still gets through). The lean apps read bodies with it
  (``asgi_io.read_body``); ``bound_body_reads`` wraps Django's app with it and with a bound on
  a body's size (``SWITCHYARD_MAX_UPLOAD_BYTES``), answering in the error shape of the front
  door the path belongs to. Both work under uvicorn and daphne.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .asgi_types import Message, Receive, Scope, Send

HEADER_TIMEOUT_MESSAGE = "the request headers did not arrive in time"
BODY_TIMEOUT_MESSAGE = "the request body stopped arriving: no data for {:g} s"
TOO_LARGE_MESSAGE = "the request body is larger than the limit of {} bytes"

App = Any  # an ASGI application: (scope, receive, send) -> None


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, with ``SWITCHYARD_HEADER_TIMEOUT_S`` from a connection's
    start (or a new request's first byte) to the end of its headers."""

    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_timer is None:  # a keep-alive connection's next request starts
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.header_timer = self.loop.call_later(
            settings.SWITCHYARD_HEADER_TIMEOUT_S, self._headers_timed_out
        )

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_timed_out(self) -> None:
        self.header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served (pipelined bytes began the next one)
        body = json.dumps({"error": HEADER_TIMEOUT_MESSAGE}).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


def error_body(path: str, message: str) -> bytes:
    """An error's body in the shape of the front door ``path`` belongs to: OpenAI's under
    ``/v1/``, the platform's ``{"error": ...}`` everywhere else (OIP v2, the REST API)."""
    if path.startswith("/v1/"):
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        return json.dumps({"error": error}).encode()
    return json.dumps({"error": message}).encode()


class StalledReads:
    """The body reads waiting now in this event loop, and when each must end.

    One timer a second checks them all and cancels the task of a read past its deadline (the
    read turns that into a 408), instead of one timer per read: ``asyncio.timeout`` around each
    ``receive()`` cost ~30 µs per request, and almost every body is in by the first read. So
    a stalled body is cut off between ``SWITCHYARD_BODY_TIMEOUT_S`` and a second after it.
    """

    SWEEP_S = 1.0

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiting: dict[asyncio.Task[Any], float] = {}
        self.expired: set[asyncio.Task[Any]] = set()
        self.timer: asyncio.TimerHandle | None = None

    def start(self, task: asyncio.Task[Any], timeout: float) -> None:
        self.waiting[task] = self.loop.time() + timeout
        if self.timer is None:
            self.timer = self.loop.call_later(self.SWEEP_S, self.sweep)

    def end(self, task: asyncio.Task[Any]) -> bool:
        """The read is over; True when it was cut off (its task was cancelled for it: the
        cancellation is taken back, and the read's ``CancelledError`` is the timeout)."""
        self.waiting.pop(task, None)
        if task in self.expired:
            self.expired.discard(task)
            task.uncancel()
            return True
        return False

    def sweep(self) -> None:
        now = self.loop.time()
        for task, deadline in list(self.waiting.items()):
            if deadline <= now:
                del self.waiting[task]
                self.expired.add(task)
                task.cancel()
        self.timer = self.loop.call_later(self.SWEEP_S, self.sweep) if self.waiting else None


_stalled: dict[asyncio.AbstractEventLoop, StalledReads] = {}


def stalled_reads() -> StalledReads:
    loop = asyncio.get_running_loop()
    found = _stalled.get(loop)
    if found is None:
        found = _stalled[loop] = StalledReads(loop)
    return found


async def read_within(receive: Receive, timeout: float) -> Message | None:
    """The next ASGI message, or None when none came within ``timeout`` (and a second)."""
    task = asyncio.current_task()
    assert task is not None  # an ASGI app runs in a task
    stalls = stalled_reads()
    stalls.start(task, timeout)
    try:
        message = await receive()
    except asyncio.CancelledError:
        if stalls.end(task):
            return None
        raise
    stalls.end(task)
    return message


def bound_body_reads(app: App) -> App:
    """Wrap an ASGI app so that an HTTP request body is bounded in time and size:

    - waiting for its next piece takes at most ``SWITCHYARD_BODY_TIMEOUT_S`` (else 408; see
      ``StalledReads``);
    - it is at most ``SWITCHYARD_MAX_UPLOAD_BYTES`` (else 413, from its ``Content-Length``
      before any of it is read, or as soon as it passes that size): Django spools a body to
      disk before any view runs, so without this a client could fill the disk.

    Either way the client gets the error (and the connection is closed), the app reads
    ``http.disconnect`` and stops as it would for a client that hung up, and whatever it sends
    afterwards is dropped. Reads after the body is complete (a wait for the client to hang up)
    are not bounded. The front doors' own tighter limits (``SWITCHYARD_MAX_BODY_BYTES`` on
    inference) apply as before."""

    async def bounded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        timeout = settings.SWITCHYARD_BODY_TIMEOUT_S
        limit = settings.SWITCHYARD_MAX_UPLOAD_BYTES
        body_done = False
        answered = False
        started = False
        size = 0

        async def refuse(status: int, message: str) -> Message:
            """Answer ``status`` unless the app has begun its own answer; the app sees the
            client leave."""
            nonlocal body_done, answered
            body_done = True  # from here on the app only waits for the client to leave
            if not started:
                answered = True
                body = error_body(scope["path"], message)
                await send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
            return {"type": "http.disconnect"}

        async def bounded_receive() -> Message:
            nonlocal body_done, size
            if body_done or answered:
                return await receive()
            if size == 0 and declared_length(scope) > limit:
                return await refuse(413, TOO_LARGE_MESSAGE.format(limit))
            message = await read_within(receive, timeout)
            if message is None:
                return await refuse(408, BODY_TIMEOUT_MESSAGE.format(timeout))
            size += len(message.get("body", b""))
            if size > limit:
                return await refuse(413, TOO_LARGE_MESSAGE.format(limit))
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if answered:
                return  # the error has answered this request
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await app(scope, bounded_receive, guarded_send)

    return bounded


def declared_length(scope: Scope) -> int:
    """The request's ``Content-Length`` (0 when absent or unreadable: the count decides)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
