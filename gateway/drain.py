"""A web process's shutdown that loses no request it accepted (SIGTERM: a restart, a deploy, a
scale-down).

uvicorn's graceful shutdown stops listening, lets each request in flight finish and closes each
idle keep-alive connection at once, then runs the lifespan shutdown (the prediction log is
flushed and this process's agent-link address deregistered there). Two of its steps lose
requests here, measured by bench/drill_restarts.py:

- A keep-alive connection closed at the instant its client sends the next request on it: the
  request is on the wire, the client gets no answer and cannot tell whether it ran (a POST is
  never sent again by a client library on its own). ``DrainingHttp`` keeps an idle connection
  open for ``SWITCHYARD_DRAIN_IDLE_S`` and serves a request that arrives in that time with
  ``Connection: close``; the client's next request then opens a connection elsewhere.
- Agents' main connections closed with the rest at once: the requests this process had sent
  to the agent over one were failed (503) instead of answered. ``draining_websockets`` makes
  the websocket class uvicorn upgrades to close an agent's socket only once no HTTP request is
  left in this process (or the server's inference deadline has passed); other websockets (a
  client's generation stream) close at once with 1012, as before, and their clients reconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import Server

from serving_agent.protocol import AGENT_WS_PATH

# uvicorn's on_tick counts tenths of a second (its Date header moves every 10; a
# --limit-max-requests check and a --timeout-notify callback too): RestingServer's tick.
TICK_S = 0.5
TENTHS_PER_TICK = 5
# How long a connection answered before its request body was read (a 408 or 413) keeps
# reading, and dropping, what its client still sends (nginx's lingering_close).
LINGER_S = 2.0


class _Lingering:
    """A connection's transport as uvicorn's request cycle sees it, with ``close`` made
    lingering (``DrainingHttp.close_lingering``) and a reply's head held back to go out with
    its body in one write (``_OneWriteCycle``); everything else is the transport's."""

    __slots__ = ("_protocol", "_transport", "hold_next", "_held")

    def __init__(self, protocol: DrainingHttp, transport: asyncio.Transport) -> None:
        self._protocol, self._transport = protocol, transport
        self.hold_next = False  # the next write is a reply's head: keep it for the body
        self._held: bytes | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        if self.hold_next:
            self.hold_next = False
            self._held = data
            return
        held = self._held
        if held is not None:
            self._held = None
            data = held + data
        self._transport.write(data)

    def flush(self) -> None:
        """Write a held head (its body will not come: the cycle ended or failed)."""
        self.hold_next = False
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self.flush()
        self._protocol.close_lingering(self._transport)


class _OneWriteCycle(RequestResponseCycle):
    """uvicorn's request cycle, whose reply head (status line and headers) goes out in one
    write with the body, not in a write of its own: each write is a system call and a wake of
    the reader, ~a tenth of the gateway's CPU per request at 64 connections (bench/README.md,
    "The gateway's own cost"). Held only where a body write surely follows in the same send
    sequence: the head names a Content-Length (a whole body, not a stream whose first chunk
    may come much later) and the request is not a HEAD (which gets no body write)."""

    # Called when the connection ends before the reply is complete: a door waiting for an
    # agent sets it (``frontdoor.DisconnectWatch``) to cancel its work without watching
    # ``receive`` in a task of its own.
    on_disconnect: Callable[[], None] | None = None

    async def send(self, message: Any) -> None:
        transport = self.transport
        if (
            message["type"] == "http.response.start"
            and not self.response_started
            and isinstance(transport, _Lingering)
            and self.scope["method"] != "HEAD"
            and any(name.lower() == b"content-length" for name, _ in message.get("headers", ()))
        ):
            transport.hold_next = True
            try:
                await super().send(message)
            except BaseException:
                transport.flush()
                raise
            return
        try:
            await super().send(message)  # a body's write takes the held head with it
        except BaseException:
            if isinstance(transport, _Lingering):
                transport.flush()
            raise


class DrainingHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, whose idle connections outlive the shutdown's start by
    ``SWITCHYARD_DRAIN_IDLE_S`` (see the module's docstring), and whose answer given before
    its request's body was read (a 408 past the body deadline, a 413) reaches the client: a
    plain close with the client's bytes unread makes the kernel send a reset, which can
    overtake the answer, and the client then sees a reset connection instead of the 408."""

    draining = False
    lingering = False
    idle_close: asyncio.TimerHandle | None = None
    linger_close: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ws_protocol_class = draining_websockets(self.ws_protocol_class)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _Lingering(self, transport)  # type: ignore[assignment]

    def close_lingering(self, transport: asyncio.Transport) -> None:
        """Close; but while the request's body is still arriving, first send the answer and
        an end of stream, and drop what the client sends for ``LINGER_S``."""
        cycle = self.cycle
        if (
            self.lingering
            or cycle is None
            or not cycle.more_body
            or transport.is_closing()
            or not transport.can_write_eof()
        ):
            transport.close()
            return
        self.lingering = True
        transport.write_eof()  # after the answer still buffered
        self.linger_close = self.loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of a body already answered: dropped
        super().data_received(data)

    def shutdown(self) -> None:
        self.draining = True
        if self.cycle is None or self.cycle.response_complete:
            self.idle_close = self.loop.call_later(
                settings.SWITCHYARD_DRAIN_IDLE_S, self.transport.close
            )
        else:
            self.cycle.keep_alive = False

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and type(self.cycle) is RequestResponseCycle:
            # The cycle uvicorn just made, as its one-write variant (same state, one method
            # more); its task has not started yet, so every send goes through the variant.
            self.cycle.__class__ = _OneWriteCycle
        if self.draining and self.cycle is not None:
            # A request that arrived while draining is served, and ends the connection.
            if self.idle_close is not None:
                self.idle_close.cancel()
                self.idle_close = None
            self.cycle.keep_alive = False

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self.idle_close, self.linger_close):
            if timer is not None:
                timer.cancel()
        self.idle_close = self.linger_close = None
        cycle = self.cycle
        super().connection_lost(exc)
        hook = getattr(cycle, "on_disconnect", None)
        if hook is not None and not cycle.response_complete:
            hook()


_draining_classes: dict[type, type] = {}


def draining_websockets(base: Any) -> Any:
    """``base`` (uvicorn's websocket protocol class) with an agent's socket closed at shutdown
    only after this process's HTTP requests are answered (see the module's docstring)."""
    if base is None:
        return None
    found = _draining_classes.get(base)
    if found is not None:
        return found

    class AgentDraining(base):
        def shutdown(self) -> None:
            scope = getattr(self, "scope", None)
            if not scope or scope.get("path") != AGENT_WS_PATH:
                super().shutdown()
                return
            self._drain = asyncio.get_running_loop().create_task(self._after_requests())

        async def _after_requests(self) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + settings.SWITCHYARD_INFER_TIMEOUT_S + 1
            # uvicorn's shutdown waits for every connection to close: the HTTP ones close as
            # their last request is answered (or, idle, after the drain's grace).
            while loop.time() < deadline and any(
                isinstance(c, HttpToolsProtocol) for c in self.connections
            ):
                await asyncio.sleep(0.05)
            super().shutdown()

    _draining_classes[base] = AgentDraining
    return AgentDraining


class RestingServer(Server):
    """uvicorn's server, whose housekeeping tick (has a shutdown been asked for; the Date
    header's second) runs every ``TICK_S`` instead of every 0.1 s: ten wake-ups a second were
    a fifth of the web process's CPU at rest (bench/idle_bench.py). A SIGTERM's drain starts
    at most ``TICK_S`` after the signal. The web command (platform_site/serve.py) and the
    agents' link server (gateway/links.py) run it."""

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + TENTHS_PER_TICK) % 864000
            await asyncio.sleep(TICK_S)
            should_exit = await self.on_tick(counter)
