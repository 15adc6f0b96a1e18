"""The platform in one process for the fuzz suite: tenant A's ``clf`` (an ONNX MLP, input ``x``
FP32 [-1, 4]) and ``echo`` (string tensors: BYTES ``t`` [-1] in, ``u`` out) answered by
in-process agent links that run ONNX Runtime, and one gateway
state that every front door (OIP v2 REST and gRPC, the prediction API, OpenAI, the generation
socket) uses.

Each hypothesis example runs on an event loop of its own (``async_to_sync``), so the gateway's
rate limiter here is the embedded default's in-process one: a Redis client belongs to the loop
that opened it. What is fuzzed is how each front door reads its input, not the limiter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator

from gateway import generate_ws, grpc_server, oip, openai_api
from gateway import state as state_module
from gateway.api import predict_app, views
from gateway.state import GatewayState
from platform_site.asgi import application
from tests.factories import make_key, make_model, make_tenant, make_version
from tests.onnx_models import echo_onnx, small_onnx
from tests.test_predict_api import OnnxAgent


@dataclass
class Platform:
    key: str
    state: GatewayState
    agent: OnnxAgent
    echo: OnnxAgent


@pytest.fixture
def platform(transactional_db, monkeypatch, settings) -> Platform:
    """Committed rows (the gateway reads them from its own threads) and one gateway state."""
    settings.REDIS_URL = ""
    settings.SWITCHYARD_MAX_BODY_BYTES = 1024 * 1024
    gateway = GatewayState()
    for module in (state_module, oip, predict_app, views, openai_api, generate_ws, grpc_server):
        monkeypatch.setattr(module, "get_state", lambda: gateway)
    tenant = make_tenant("alpha")
    artifact = small_onnx()
    version = make_version(make_model(tenant, "clf"), artifact)
    echo = make_version(make_model(tenant, "echo"), echo_onnx())
    return Platform(
        make_key(tenant)[1],
        gateway,
        OnnxAgent(gateway, version.pk, artifact),
        OnnxAgent(gateway, echo.pk, echo_onnx()),
    )


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


def request(
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> Reply:
    """One request to the real ASGI application (its router, the lean apps and Django)."""

    async def send() -> Reply:
        # A Host that ALLOWED_HOSTS takes, as a client sends it (without one Django refuses
        # every request with a 400 before any view).
        sent = [(b"host", b"127.0.0.1"), *(headers or [])]
        communicator = HttpCommunicator(application, method, path, body=body, headers=sent)
        response = await communicator.get_response(timeout=10)
        got = {k.decode().lower(): v.decode("latin-1") for k, v in response["headers"]}
        return Reply(response["status"], got, response["body"])

    return async_to_sync(send)()


def bearer(key: str) -> tuple[bytes, bytes]:
    return (b"authorization", f"Bearer {key}".encode())
