"""Bounds on reading a request that the ASGI servers do not set on their own: time and size.

uvicorn closes an idle keep-alive connection, but a connection whose request headers never
finish (slowloris), and a request whose body stops arriving or trickles in, stay open for as
long as the client likes; httptools takes headers of any size; and Django spools any body to
disk, however large, before a view can refuse it. These bounds answer 408, 413 or 431 and
close the connection:

- ``BoundedHttpProtocol``: uvicorn's httptools protocol with a header timeout (from the
  connection's start, or the first byte of a request, to its last header: a total, so headers
  sent a byte at a time are cut off too) and a bound on the headers' size. Run uvicorn with
  ``--http gateway.http_bounds:BoundedHttpProtocol`` (the Procfile, Dockerfile and
  deploy/web.yaml do).
- ``BodyDeadline``: a body read that waits at most ``SWITCHYARD_BODY_TIMEOUT_S`` for the next
  piece (nginx's ``client_body_timeout``: the gap between two reads), and takes at most
  ``SWITCHYARD_BODY_DEADLINE_S`` in all, plus a second per ``SWITCHYARD_BODY_MIN_RATE`` bytes
  received (Apache's ``mod_reqtimeout`` ``MinRate``: a large upload on a link at least that
  fast still gets through). The lean apps read bodies with it (``asgi_io.read_body``);
  ``bound_body_reads`` wraps Django's app with it and with a bound on a body's size
  (``SWITCHYARD_MAX_UPLOAD_BYTES``), answering in the error shape of the front door the path
  belongs to. Both work under uvicorn and daphne.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .asgi_types import Message, Receive, Scope, Send
from .drain import DrainingHttp

HEADER_TIMEOUT_MESSAGE = "the request headers did not arrive in time"
HEADERS_TOO_LARGE_MESSAGE = "the request headers are larger than the limit of {} bytes"
BODY_TIMEOUT_MESSAGE = "the request body stopped arriving: no data for {:g} s"
BODY_DEADLINE_MESSAGE = "the request body arrived too slowly: not complete within {:g} s"
TOO_LARGE_MESSAGE = "the request body is larger than the limit of {} bytes"

App = Any  # an ASGI application: (scope, receive, send) -> None


class BoundedHttpProtocol(DrainingHttp):
    """uvicorn's HTTP/1.1 protocol, with ``SWITCHYARD_HEADER_TIMEOUT_S`` from a connection's
    start (or a new request's first byte) to the end of its headers, and at most
    ``SWITCHYARD_MAX_HEADER_BYTES`` of headers (httptools keeps a header of any size whole:
    a 20 MB one was taken). The timeout is kept by ``UnfinishedHeaders``, not a timer per
    request."""

    headers_due = False  # this connection's request headers are unfinished, and watched
    header_bytes = 0  # received since the headers began to be watched, while they are
    header_round = 0  # counts the watches: a pipelined request's headers are a new one

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        watched = self.header_round if self.headers_due else None
        super().data_received(data)
        # Counted only when this request's headers were unfinished before the data and still
        # are after it, so that the data holds nothing but their bytes (not a body before).
        if watched is None or not self.headers_due or self.header_round != watched:
            return
        self.header_bytes += len(data)
        limit = settings.SWITCHYARD_MAX_HEADER_BYTES
        if self.header_bytes > limit and not self.transport.is_closing():
            self._disarm()
            if self.cycle is not None and not self.cycle.response_complete:
                self.transport.close()  # pipelined behind a response: no room for an answer
            else:
                message = HEADERS_TOO_LARGE_MESSAGE.format(limit)
                self._refuse(b"431 Request Header Fields Too Large", message)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self.headers_due:  # a keep-alive connection's next request starts
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.header_bytes = 0
        self.headers_due = True
        self.header_round += 1
        UnfinishedHeaders.of(self.loop).add(self, settings.SWITCHYARD_HEADER_TIMEOUT_S)

    def _disarm(self) -> None:
        if self.headers_due:
            self.headers_due = False
            UnfinishedHeaders.of(self.loop).due.pop(self, None)

    def headers_timed_out(self) -> None:
        self.headers_due = False
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served (pipelined bytes began the next one)
        self._refuse(b"408 Request Timeout", HEADER_TIMEOUT_MESSAGE)

    def _refuse(self, status: bytes, message: str) -> None:
        """Answer a request whose headers are unfinished (the app never saw it), and close."""
        body = json.dumps({"error": message}).encode()
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(body), body)
        )
        self.transport.close()


class UnfinishedHeaders:
    """The connections of one event loop whose request headers are unfinished, and when each
    must be. A timer made and cancelled per request cost ~3 µs of CPU, for headers that
    almost always arrive in the packet that began them (bench/README.md, "The gateway's own
    cost"); instead one timer, running only while some headers are unfinished, checks them
    every ``SWEEP_S``, so a connection is cut off between its timeout and ``SWEEP_S`` after."""

    SWEEP_S = 0.5
    _loops: dict[asyncio.AbstractEventLoop, UnfinishedHeaders] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.due: dict[BoundedHttpProtocol, float] = {}
        self.timer: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> UnfinishedHeaders:
        found = cls._loops.get(loop)
        if found is None:
            found = cls._loops[loop] = cls(loop)
        return found

    def add(self, protocol: BoundedHttpProtocol, timeout: float) -> None:
        self.due[protocol] = self.loop.time() + timeout
        if self.timer is None:
            self.timer = self.loop.call_later(self.SWEEP_S, self.sweep)

    def sweep(self) -> None:
        now = self.loop.time()
        for protocol, due in list(self.due.items()):
            if due <= now:
                del self.due[protocol]
                protocol.headers_timed_out()
        self.timer = self.loop.call_later(self.SWEEP_S, self.sweep) if self.due else None


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


@functools.cache
def body_times() -> tuple[float, float, float]:
    """The body's bounds, read once per process (again when a test changes them): the gap
    between two pieces, the deadline for the whole, and the seconds each byte received adds.
    Every request reads them, and each read of a Django setting costs about a microsecond
    (``LazySettings.__getattribute__``)."""
    rate = settings.SWITCHYARD_BODY_MIN_RATE
    per_byte = 1 / rate if rate > 0 else 0.0
    return settings.SWITCHYARD_BODY_TIMEOUT_S, settings.SWITCHYARD_BODY_DEADLINE_S, per_byte


@receiver(setting_changed)
def _body_settings_changed(setting: str, **_: Any) -> None:
    if setting.startswith("SWITCHYARD_BODY_"):
        body_times.cache_clear()


class BodyDeadline:
    """The time a request body may still take, from its first read: each piece within
    ``SWITCHYARD_BODY_TIMEOUT_S`` of the last, and the whole within
    ``SWITCHYARD_BODY_DEADLINE_S`` plus a second for every ``SWITCHYARD_BODY_MIN_RATE`` bytes
    received. The gap alone let a body sent a byte every 8 s hold its connection for ever (3,000
    of 3,000 held); a total alone would cut off a large upload on a slow but honest link, so it
    grows with what arrives, as Apache's ``mod_reqtimeout`` does: holding a connection costs a
    client that rate."""

    def __init__(self) -> None:
        self.gap, self.allowed, self.per_byte = body_times()
        self.started = time.monotonic()
        self.late = ""  # why the body was cut off, once it was

    async def read(self, receive: Receive) -> Message | None:
        """The next message, or None when the body is too late (``late`` says how)."""
        left = self.started + self.allowed - time.monotonic()
        message = await read_within(receive, min(self.gap, left)) if left > 0 else None
        if message is None:
            if left > self.gap:
                self.late = BODY_TIMEOUT_MESSAGE.format(self.gap)
            else:
                self.late = BODY_DEADLINE_MESSAGE.format(round(self.allowed, 1))
            return None
        self.allowed += len(message.get("body", b"")) * self.per_byte
        return message


def bound_body_reads(app: App) -> App:
    """Wrap an ASGI app so that an HTTP request body is bounded in time and size:

    - it arrives within ``BodyDeadline`` (else 408);
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
        limit = settings.SWITCHYARD_MAX_UPLOAD_BYTES
        deadline: BodyDeadline | None = None  # from the first read of the body
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
            nonlocal body_done, size, deadline
            if body_done or answered:
                return await receive()
            if size == 0 and declared_length(scope) > limit:
                return await refuse(413, TOO_LARGE_MESSAGE.format(limit))
            deadline = deadline or BodyDeadline()
            message = await deadline.read(receive)
            if message is None:
                return await refuse(408, deadline.late)
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
