from django.urls import path

from serving_agent.protocol import AGENT_WS_PATH

from .consumers import AgentConsumer

websocket_urlpatterns = [
    path(AGENT_WS_PATH.lstrip("/"), AgentConsumer.as_asgi()),
]
