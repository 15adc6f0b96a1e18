"""The websocket routes: the agents' socket, the generation stream and the web UI's live socket."""

from channels.auth import AuthMiddlewareStack
from django.urls import path

from gateway.consumers import AgentConsumer
from gateway.generate_ws import GenerateConsumer
from platform_site.origins import same_origin_only
from serving_agent.protocol import AGENT_WS_PATH
from web.live import LiveConsumer

websocket_urlpatterns = [
    path(AGENT_WS_PATH.lstrip("/"), AgentConsumer.as_asgi()),
    # Generation streams authenticate with the tenant's API key; the UI's playground with the
    # session (same-origin only, checked in the consumer: key clients send no Origin, and need
    # none, since a key is never sent by a browser on its own as a cookie is).
    path("ws/v1/models/<str:name>/generate", AuthMiddlewareStack(GenerateConsumer.as_asgi())),
    # The UI's socket rides on the session cookie, so its Origin must be this site's exact
    # scheme, host and port (platform_site.origins: no other page may open it with a user's
    # cookie); agents send no Origin, so the check and the session lookup wrap this route only.
    path("ws/ui/live/", same_origin_only(AuthMiddlewareStack(LiveConsumer.as_asgi()))),
]
