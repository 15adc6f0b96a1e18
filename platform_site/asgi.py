"""ASGI entry point: the lean OIP v2 app for ``/v2``, Django for the rest, Channels for sockets.

Run it under uvicorn (the measured default) or daphne (which sends no lifespan events: the
first request starts gRPC and the agents' link address, see ``ProcessServers``).
"""

import asyncio
import logging
import os
import sys
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")
django_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import path  # noqa: E402

from gateway import grpc_server, links  # noqa: E402
from gateway.api.predict_app import predict_app, predict_url  # noqa: E402
from gateway.asgi_types import Receive, Scope, Send  # noqa: E402
from gateway.consumers import AgentConsumer  # noqa: E402
from gateway.embeddings import embeddings_app  # noqa: E402
from gateway.http_bounds import bound_body_reads  # noqa: E402
from gateway.oip import oip_app  # noqa: E402
from gateway.scrape import metrics_app  # noqa: E402
from gateway.state import all_states, get_state  # noqa: E402
from platform_site import telemetry  # noqa: E402
from platform_site.routing import websocket_urlpatterns  # noqa: E402
from serving_agent.protocol import AGENT_WS_PATH  # noqa: E402

# Static files (the admin's CSS and JS) are served by Django's own ASGI static handler on their
# own path, so no sync-only middleware (WhiteNoise) sits in Django's chain: one such middleware
# forced sync/async hops on every request and stalled the prediction API at 64 clients.
static_app = ASGIStaticFilesHandler(django_app)
# Django reads (and spools to disk) a whole body before any view runs: its bodies are bounded
# in time and size here (408/413). The lean apps bound their own in ``asgi_io.read_body``.
bounded_django_app = bound_body_reads(django_app)
STATIC_PREFIX = "/" + settings.STATIC_URL.lstrip("/")
log = logging.getLogger(__name__)
# Each server process (uvicorn's workers are spawned, each imports this) exports its own spans;
# off unless OTEL_TRACES_EXPORTER is set (docs/observability.md, "Traces").
telemetry.configure("switchyard-gateway")


async def http_app(scope: Scope, receive: Receive, send: Send) -> None:
    path = scope["path"]
    if path == "/v2" or path.startswith("/v2/"):
        await oip_app(scope, receive, send)
    elif path == "/v1/embeddings":  # OpenAI's, served lean as OIP is
        await embeddings_app(scope, receive, send)
    elif path == "/metrics":
        await metrics_app(scope, receive, send)
    elif (predict := predict_url(scope)) is not None:  # the prediction API, before Django
        await predict_app(predict, scope, receive, send)
    elif path.startswith(STATIC_PREFIX):
        await static_app(scope, receive, send)
    else:
        await bounded_django_app(scope, receive, send)


# Agents' data links to this process: only the agent socket is served on that address.
link_app = ProtocolTypeRouter(
    {
        "http": links.not_found,
        "websocket": URLRouter([path(AGENT_WS_PATH.lstrip("/"), AgentConsumer.as_asgi())]),
    }
)


class ProcessServers:
    """This process's servers beside the ASGI one: its link address for agents (with several
    gateway processes) and OIP v2 over gRPC.

    uvicorn starts and stops them with the ASGI lifespan. Daphne sends no lifespan events, so
    where no lifespan startup was seen the first scope of any type starts them, once, in the
    background: that scope is not delayed, and a failure is logged, never that request's. A
    failed start is tried again by the first scope ``RETRY_S`` later (not on every request,
    which would log each), and under daphne the reactor's shutdown stops them.
    """

    RETRY_S = 5.0

    def __init__(self) -> None:
        self.lifespan = False  # a lifespan startup was seen: the lifespan starts and stops them
        self.started = False
        self._starting: asyncio.Task[None] | None = None  # the flag: one start at a time
        self._retry_at = 0.0
        self._stop_hooked = False
        self._stopped = False  # the process is stopping: a late request starts nothing again

    def on_scope(self) -> None:
        """Start them, in the background, unless started, starting, or the lifespan's."""
        if self.started or self.lifespan or self._starting is not None or self._stopped:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._retry_at:
            return
        self._starting = loop.create_task(self._start_lazily())

    async def _start_lazily(self) -> None:
        try:
            await self.start()
        except Exception:
            self._retry_at = asyncio.get_running_loop().time() + self.RETRY_S
            log.exception(
                "could not start the gRPC server or the agents' link address (no ASGI "
                "lifespan: started by the first request); tried again in %.0f s",
                self.RETRY_S,
            )
        else:
            self._stop_with_twisted()
        finally:
            self._starting = None

    async def start(self) -> None:
        """Start what is not running yet (after a partial failure, the rest)."""
        if links.links_enabled() and get_state().link_listener is None:
            await start_links()
        if not grpc_server.running():
            await grpc_server.start()
        self.started = True

    async def stop(self) -> None:
        """Close both, then write what the prediction log still buffers."""
        self.started, self._stopped = False, True
        await grpc_server.stop()
        await stop_links()
        await flush_prediction_logs()

    def _stop_with_twisted(self) -> None:
        """Under daphne (Twisted's asyncio reactor, already imported and running), stop them
        before the reactor stops, as a lifespan shutdown would: Twisted waits for it."""
        reactor: Any = sys.modules.get("twisted.internet.reactor")
        if self._stop_hooked or reactor is None or not getattr(reactor, "running", False):
            return
        from twisted.internet import defer

        def stop() -> object:
            return defer.Deferred.fromFuture(asyncio.ensure_future(self.stop()))

        reactor.addSystemEventTrigger("before", "shutdown", stop)
        self._stop_hooked = True


servers = ProcessServers()


async def lifespan_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Start this process's servers (``ProcessServers``); on shutdown, stop them."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            servers.lifespan = True
            try:
                await servers.start()
            except Exception as exc:  # a start-up that cannot serve agents must say so
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await servers.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def start_links() -> None:
    if links.links_enabled():
        state = get_state()
        listener = links.link_listener(link_app)
        try:
            await listener.start()
        except BaseException:  # bound but not registered (the database is down): close it
            await listener.stop()
            raise
        state.link_listener = listener


async def stop_links() -> None:
    for state in all_states():
        if state.link_listener is not None:
            await state.link_listener.stop()
            state.link_listener = None


async def flush_prediction_logs(timeout_s: float = 5.0) -> None:
    """Write what the prediction log still buffers before the process exits (what a stalled
    storage does not take by then is counted and logged as lost)."""
    for state in all_states():
        await asyncio.to_thread(state.predlog.close, timeout_s)
        await asyncio.to_thread(state.genlog.close, timeout_s)


router = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": URLRouter(websocket_urlpatterns),
        "lifespan": lifespan_app,
    }
)


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    if not servers.started and scope["type"] != "lifespan":
        servers.on_scope()  # no lifespan (daphne): the first scope starts them
    await router(scope, receive, send)
