"""``Idempotency-Key`` on inference (gateway.idempotency), through the real ASGI application: a
retried OIP v2 infer, prediction or OpenAI completion reaches the agent once and gets the first
answer; the key reused for another body is a 422, one still running a 409, a malformed one a 400
in each protocol's own shape; keys are per tenant and key. On PostgreSQL + Redis the answers are
in Redis; on the embedded default in process. The agents are in-process links (the real
processes are in tests/e2e/test_idempotency_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import pytest
import redis
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.test import AsyncClient

from gateway import idempotency, oip, openai_api
from gateway import state as state_module
from gateway.api import predict_app, views
from gateway.state import GatewayState
from platform_site.asgi import application
from tenants.idempotency import Stored
from tests.factories import make_model, make_version
from tests.test_generation import FakeAgent, make_textgen
from tests.test_predict_api import FEATURES, OnnxAgent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.backends]

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1] * 4}]}
OTHER = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.7] * 4}]}
OIP = "/v2/models/clf/infer"
PREDICT = "/api/v1/models/clf/predict"
Reply = tuple[int, dict[str, str], dict]


@pytest.fixture
def state(monkeypatch) -> GatewayState:
    """A gateway state of the test's own; on Redis, no answers kept from an earlier run (ids
    start again with each test database)."""
    if os.environ.get("REDIS_URL"):
        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        for name in client.scan_iter(idempotency.REDIS_PREFIX + "*"):
            client.delete(name)
    gateway = GatewayState()
    for module in (oip, predict_app, views, state_module, openai_api):
        monkeypatch.setattr(module, "get_state", lambda: gateway)
    return gateway


@pytest.fixture
def served(world, state, onnx_bytes):
    """Tenant A's ``clf`` in production, answered by an ONNX agent that counts requests; tenant
    B has a ``clf`` of its own on another agent."""
    version = make_version(make_model(world.a, "clf"), onnx_bytes, feature_names=FEATURES)
    world.agent = OnnxAgent(state, version.pk, onnx_bytes)
    other = make_version(make_model(world.b, "clf"), onnx_bytes, feature_names=FEATURES)
    world.agent_b = OnnxAgent(state, other.pk, onnx_bytes)
    return world


async def send(path: str, body: dict | bytes, key: str, idem: str | None = None) -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = [(b"authorization", f"Bearer {key}".encode())]
    headers.append((b"content-type", b"application/json"))
    if idem is not None:
        headers.append((b"idempotency-key", idem.encode()))
    communicator = HttpCommunicator(application, "POST", path, body=raw, headers=headers)
    response = await communicator.get_response(timeout=10)
    got = {k.decode().lower(): v.decode() for k, v in response["headers"]}
    return response["status"], got, json.loads(response["body"])


def run(*calls: tuple) -> list[Reply]:
    """The replies, one after the other on one event loop (Redis clients belong to a loop)."""

    async def scenario() -> list[Reply]:
        return [await send(*call) for call in calls]

    return async_to_sync(scenario)()


def test_a_retried_oip_infer_is_computed_once_and_answered_alike(served):
    first, second = run((OIP, BODY, served.key_a, "inf-1"), (OIP, BODY, served.key_a, "inf-1"))
    assert first[0] == second[0] == 200
    assert second[2] == first[2]
    assert second[1]["idempotent-replayed"] == "true" and "idempotent-replayed" not in first[1]
    assert len(served.agent.requests) == 1
    # Without a key, each request is computed.
    run((OIP, BODY, served.key_a), (OIP, BODY, served.key_a))
    assert len(served.agent.requests) == 3


def test_a_retried_prediction_is_computed_once(served):
    rows = {"instances": [{"amount": 1.0, "hour": 2.0, "risk": 0.5, "age": 40.0}]}
    first, second = run((PREDICT, rows, served.key_a, "p-1"), (PREDICT, rows, served.key_a, "p-1"))
    assert first[0] == second[0] == 200, first
    assert second[2] == first[2] and second[1]["idempotent-replayed"] == "true"
    assert len(served.agent.requests) == 1


def test_the_key_reused_for_another_body_is_a_422_and_is_not_computed(served):
    replies = run(
        (OIP, BODY, served.key_a, "inf-2"),
        (OIP, OTHER, served.key_a, "inf-2"),
        (PREDICT, {"instances": [[1, 2, 3, 4]]}, served.key_a, "inf-2"),
    )
    assert [r[0] for r in replies] == [200, 422, 422]
    assert replies[1][2]["error"].startswith("Idempotency-Key: 'inf-2' was already used")
    assert len(served.agent.requests) == 1


@pytest.mark.parametrize("bad", ["x" * 256, "two words", "é"], ids=["long", "space", "latin1"])
def test_a_malformed_key_is_a_400_before_anything_is_computed(served, bad):
    (status, _, body), (p_status, _, p_body) = run(
        (OIP, BODY, served.key_a, bad), (PREDICT, {"instances": [[1, 2, 3, 4]]}, served.key_a, bad)
    )
    assert status == p_status == 400
    assert body["error"].startswith("Idempotency-Key: must be 1 to 255 printable ASCII")
    assert p_body["error"] == body["error"]
    assert served.agent.requests == []


def test_keys_are_per_tenant_and_key(served):
    a, b = run((OIP, BODY, served.key_a, "same"), (OIP, OTHER, served.key_b, "same"))
    # B's request with A's key and another body is B's own: computed by B's agent, no 422.
    assert a[0] == b[0] == 200 and "idempotent-replayed" not in b[1]
    assert len(served.agent.requests) == len(served.agent_b.requests) == 1
    assert a[2]["outputs"] != b[2]["outputs"]


def test_a_failed_request_frees_its_key_for_the_retry(served):
    served.agent.overloaded = True
    ((status, headers, _),) = run((OIP, BODY, served.key_a, "retry-me"))
    assert status == 503
    served.agent.overloaded = False
    ((status, headers, _),) = run((OIP, BODY, served.key_a, "retry-me"))
    assert status == 200 and "idempotent-replayed" not in headers
    assert len(served.agent.requests) == 2


def test_a_retry_while_the_first_runs_gets_409(served):
    """The agent holds the first request; the retry arrives meanwhile."""

    async def scenario() -> tuple[Reply, Reply]:
        held: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reached = asyncio.Event()
        answer = served.agent.receive

        async def hold_then_answer(message: bytes) -> None:
            reached.set()
            await held
            await answer(message)

        served.agent.link.send_message = hold_then_answer
        first = asyncio.ensure_future(send(OIP, BODY, served.key_a, "slow"))
        # The retry goes once the first holds the key (it reached the agent), however slow the
        # machine: a fixed pause let a loaded CI send the retry first, which then waited.
        await asyncio.wait_for(reached.wait(), 10)
        second = await send(OIP, BODY, served.key_a, "slow")
        held.set_result(None)
        return await first, second

    first, second = async_to_sync(scenario)()
    assert second[0] == 409 and second[1]["retry-after"] == "1"
    assert "still being processed" in second[2]["error"]
    assert first[0] == 200 and len(served.agent.requests) == 1


def test_a_retried_openai_completion_generates_once(world, state):
    version = make_textgen(make_model(world.a, "writer", task="generator"), max_output_tokens=64)
    body = {"model": "writer", "prompt": "hello", "max_tokens": 5}

    async def scenario():
        agent = FakeAgent(state, version.pk)
        client = AsyncClient()
        headers = {"Authorization": f"Bearer {world.key_a}", "Idempotency-Key": "c-1"}
        replies = []
        for sent in (body, body, body | {"max_tokens": 3}, body | {"stream": True}):
            replies.append(
                await client.post("/v1/completions", sent, "application/json", headers=headers)
            )
        return agent, replies

    agent, (first, second, other, streamed) = async_to_sync(scenario)()
    assert first.status_code == second.status_code == 200
    assert second.json() == first.json() and second["Idempotent-Replayed"] == "true"
    assert second["x-switchyard-version"] == first["x-switchyard-version"] == "1"
    assert other.status_code == 422
    assert other.json()["error"]["type"] == "invalid_request_error"
    # A stream cannot be given again: its key is not used, and it is generated.
    assert streamed.status_code == 200 and streamed.streaming
    assert len(agent.requests) == 2


def test_the_local_store_is_bounded_in_bytes():
    store = idempotency.LocalAnswers(retention_s=60, pending_s=5, max_bytes=10_000)

    async def fill() -> None:
        for n in range(100):
            claim = await idempotency.claim(store, 1, 1, f"k{n}", "POST", "/p", b"x")
            assert claim is not None and claim.replay is None
            await claim.keep(200, [], b"y" * 1000)

    async_to_sync(fill)()
    assert store.size <= 10_000 and len(store._entries) < 10
    # The newest answers are kept, the oldest went first.
    assert "1:1:k99" in store._entries and "1:1:k0" not in store._entries


def test_while_redis_is_unreachable_the_process_keeps_answers_itself():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    store = idempotency.RedisAnswers(url, idempotency.LocalAnswers(60, 5, 10_000))

    async def scenario() -> tuple[object, object]:
        first = await idempotency.claim(store, 1, 1, "k", "POST", "/p", b"x")
        assert first is not None and first.replay is None
        store.circuit._retry_at = 0.0  # Redis may be tried again before the answer is kept
        await first.keep(200, [("x-switchyard-arm", "baseline")], b"answer")
        retry = await idempotency.claim(store, 1, 1, "k", "POST", "/p", b"x")
        assert retry is not None
        return retry.replay, "1:1:k" in store.local

    replay, kept_locally = async_to_sync(scenario)()
    assert kept_locally
    assert replay == Stored(200, [("x-switchyard-arm", "baseline")], b"answer")
