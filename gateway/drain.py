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
from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serving_agent.protocol import AGENT_WS_PATH

# How long a connection answered before its request body was read (a 408 or 413) keeps
# reading, and dropping, what its client still sends (nginx's lingering_close).
LINGER_S = 2.0


class _Lingering:
    """A connection's transport as uvicorn's request cycle sees it, with ``close`` made
    lingering (``DrainingHttp.close_lingering``); everything else is the transport's."""

    def __init__(self, protocol: DrainingHttp, transport: asyncio.Transport) -> None:
        self._protocol, self._transport = protocol, transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_lingering(self._transport)


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
        super().connection_lost(exc)


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
