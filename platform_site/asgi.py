"""ASGI entry point: the lean OIP v2 app for ``/v2``, Django for the rest, Channels for sockets.

Run it under uvicorn (the measured default) or daphne.
"""

import asyncio
import os

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


async def lifespan_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Start this process's link address for agents (with several gateway processes) and its
    gRPC server; on shutdown, close both and write what the prediction log still buffers."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await start_links()
                await grpc_server.start()
            except Exception as exc:  # a start-up that cannot serve agents must say so
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await grpc_server.stop()
            await stop_links()
            await flush_prediction_logs()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def start_links() -> None:
    if links.links_enabled():
        state = get_state()
        state.link_listener = links.link_listener(link_app)
        await state.link_listener.start()


async def stop_links() -> None:
    for state in all_states():
        if state.link_listener is not None:
            await state.link_listener.stop()


async def flush_prediction_logs(timeout_s: float = 5.0) -> None:
    """Write what the prediction log still buffers before the process exits (what a stalled
    database does not take by then is counted and logged as lost)."""
    for state in all_states():
        await asyncio.to_thread(state.predlog.close, timeout_s)


application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": URLRouter(websocket_urlpatterns),
        "lifespan": lifespan_app,
    }
)
