"""This gateway process's own address for agents' data links.

With several gateway processes (``uvicorn --workers N``, several web pods) an agent's main
connection lands on one of them. So that every process can hand a request to an agent in
process, each process also listens on an address of its own (an ephemeral port, or a fixed
one in a pod) for the agents' data links, registers that address (``fleet.gateways``), and
the process holding an agent's main connection tells it every other process's address
(``serving_agent.protocol.Links``). The data link is the same Channels websocket as the main
connection, served by a second uvicorn server inside this process on this process's socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Iterator

import uvicorn
from django.conf import settings

from fleet import gateways
from serving_agent.protocol import AGENT_WS_PATH

from .asgi_types import Receive, Scope, Send
from .db import db_call
from .drain import RestingServer

log = logging.getLogger(__name__)


class _LinkServer(RestingServer):
    """A uvicorn server that leaves the process's signals to the process's own server: that
    one stops on SIGTERM, and its lifespan shutdown stops this one after the requests in
    flight are answered."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class LinkListener:
    """Serves ``app`` (the agent websocket route) on this process's own socket."""

    def __init__(self, app: object, host: str, port: int, advertise: str) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.advertise = advertise
        self.key = uuid.uuid4().hex
        self.url = ""
        self._server: _LinkServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Bind, serve, register; returns the URL agents open data links to."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,  # type: ignore[arg-type]  # an ASGI 3 app; uvicorn's union is narrower
            lifespan="off",
            access_log=False,
            log_config=None,
            ws_ping_interval=20.0,
        )
        self._server = _LinkServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the link server stopped as it started")
            await asyncio.sleep(0.01)
        host = self.advertise or self.host
        if ":" in host:
            host = f"[{host}]"
        self.url = f"ws://{host}:{port}{AGENT_WS_PATH}"
        await db_call(gateways.register_gateway)(self.key, self.url, _me())
        log.info("agents' data links to this process: %s", self.url)
        return self.url

    async def stop(self) -> None:
        """Deregister, then close the data links (agents drop them and keep the others)."""
        try:
            await db_call(gateways.deregister_gateway)(self.key)
        except Exception:  # the database is down: the row expires by itself
            log.warning("could not deregister this gateway process", exc_info=True)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait({self._task}, timeout=10)


def _me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def not_found(scope: Scope, receive: Receive, send: Send) -> None:
    """Plain HTTP on the link socket: only agents' websockets are served here."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def links_enabled() -> bool:
    return bool(settings.SWITCHYARD_AGENT_LINKS)


def link_listener(app: object) -> LinkListener:
    return LinkListener(
        app,
        settings.SWITCHYARD_LINK_HOST,
        settings.SWITCHYARD_LINK_PORT,
        settings.SWITCHYARD_LINK_ADVERTISE,
    )
