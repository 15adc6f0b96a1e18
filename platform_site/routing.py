"""The websocket routes: the agents' socket, the generation stream and the web UI's live socket."""

from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from gateway.consumers import AgentConsumer
from gateway.generate_ws import GenerateConsumer
from serving_agent.protocol import AGENT_WS_PATH
from web.live import LiveConsumer

websocket_urlpatterns = [
    path(AGENT_WS_PATH.lstrip("/"), AgentConsumer.as_asgi()),
    # Generation streams authenticate with the tenant's API key; the UI's playground with the
    # session (same-origin only, checked in the consumer, since key clients send no Origin).
    path("ws/v1/models/<str:name>/generate", AuthMiddlewareStack(GenerateConsumer.as_asgi())),
    # The UI's socket rides on the session cookie, so it checks the Origin against ALLOWED_HOSTS
    # (no other site may open it with a user's cookie); agents send no Origin, so the check and
    # the session lookup wrap this route only.
    path(
        "ws/ui/live/",
        AllowedHostsOriginValidator(AuthMiddlewareStack(LiveConsumer.as_asgi())),
    ),
]
