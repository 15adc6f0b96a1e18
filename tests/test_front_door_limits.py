"""Bounded front doors, in process: each API key's requests in flight at once (OIP v2, the
prediction API, OpenAI), OpenAI streams shed before the 200, and generation websockets and
OpenAI streams that stop when their key is revoked. The real server's bounds (read timeouts,
streamed uploads) are in tests/e2e/test_front_doors_e2e.py."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator

from gateway import generate_ws, oip, openai_api
from gateway import state as state_module
from gateway.api import predict_app, views
from gateway.dispatch import AgentLink
from gateway.state import GatewayState
from platform_site.asgi import application
from registry.models import ModelVersion
from serving_agent._serving import result_frame
from serving_agent.protocol import (
    GenerateRequest,
    InferError,
    InferRequest,
    decode_frame,
    encode_frame,
    unpack_frames,
)
from tenants.keys import create_api_key, revoke_api_key, set_key_max_in_flight
from tenants.models import ApiKey, AuditEvent
from tenants.ratelimit import InFlightLimit
from tests.factories import make_model, make_version
from tests.test_generation import FakeAgent, frames_until_end, make_textgen, socket
from tests.test_grpc_server import X, bearer, infer_request, serve, site  # noqa: F401 (a fixture)

FEATURES = ["amount", "hour", "risk", "age"]
OIP_BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]}
PREDICT_BODY = {"instances": [[0, 0, 0, 0]]}


class HeldAgent:
    """A link in the pool that holds every request until ``answer_all`` (zeros for each)."""

    def __init__(self, state: GatewayState, version_id: int) -> None:
        self.pool = state.pool
        self.held: list[tuple[InferRequest, int]] = []  # each request and its batch size
        self.arrived = asyncio.Event()
        self.link = AgentLink("held", self.receive)
        self.pool.add(self.link)
        self.pool.set_ready(self.link, version_id, True)

    async def receive(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            request, arrays = decode_frame(frame)
            assert isinstance(request, InferRequest)
            self.held.append((request, len(arrays[0])))
            self.arrived.set()

    def answer_all(self) -> None:
        for request, rows in self.held:
            out = [np.zeros((rows, 2), dtype=np.float32)]
            self.pool.deliver(self.link, result_frame(request.id, ["y"], out))
        self.held = []


@pytest.fixture
def state(monkeypatch) -> GatewayState:
    gateway = GatewayState()
    for module in (predict_app, views, state_module, generate_ws, openai_api, oip):
        monkeypatch.setattr(module, "get_state", lambda: gateway)
    return gateway


async def send(path: str, body: dict, key: str) -> tuple[int, dict[str, str], dict]:
    headers = [
        (b"authorization", f"Bearer {key}".encode()),
        (b"content-type", b"application/json"),
    ]
    communicator = HttpCommunicator(
        application, "POST", path, body=json.dumps(body).encode(), headers=headers
    )
    response = await communicator.get_response(timeout=10)
    got = {k.decode().lower(): v.decode() for k, v in response["headers"]}
    return response["status"], got, json.loads(response["body"])


# In-flight places per key ---------------------------------------------------------------------


def test_in_flight_places_are_counted_per_key_and_given_back() -> None:
    limit = InFlightLimit()
    assert limit.enter((1, 1), 2) and limit.enter((1, 1), 2)
    assert not limit.enter((1, 1), 2)  # the third of a key allowed two
    assert limit.enter((1, 2), 2)  # another key of the tenant is not affected
    limit.leave((1, 1))
    assert limit.enter((1, 1), 2)
    for _ in range(3):
        limit.leave((1, 1))
    limit.leave((1, 2))
    assert limit.counts == {}  # idle keys leave nothing behind


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path, body",
    [("/v2/models/clf/infer", OIP_BODY), ("/api/v1/models/clf/predict", PREDICT_BODY)],
    ids=["oip", "prediction-api"],
)
def test_a_key_past_its_in_flight_limit_gets_429_at_once(world, state, onnx_bytes, path, body):
    version = make_version(make_model(world.a, "clf"), onnx_bytes, feature_names=FEATURES)
    key, raw = create_api_key(world.a, "two at once", max_in_flight=2)

    async def scenario():
        agent = HeldAgent(state, version.pk)
        held = [asyncio.ensure_future(send(path, body, raw)) for _ in range(2)]
        while len(agent.held) < 2:  # both are at the agent, holding the key's two places
            await asyncio.sleep(0.01)
        refused = await send(path, body, raw)
        other_key = asyncio.ensure_future(send(path, body, world.key_a))
        while len(agent.held) < 3:  # the tenant's other key still gets to the agent
            await asyncio.sleep(0.01)
        agent.answer_all()
        answered = await asyncio.gather(*held, other_key)
        after = asyncio.ensure_future(send(path, body, raw))
        while not agent.held:
            await asyncio.sleep(0.01)
        agent.answer_all()
        return refused, answered, await after, dict(state.in_flight.counts)

    refused, answered, after, counts = async_to_sync(scenario)()
    status, headers, error = refused
    assert status == 429 and headers["retry-after"] == "1"
    assert "too many requests in flight for this API key (at most 2" in error["error"]
    assert [a[0] for a in answered] == [200, 200, 200] and after[0] == 200
    assert counts == {}  # every place was given back


@pytest.mark.django_db
def test_a_failed_request_gives_its_place_back(world, state, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    _, raw = create_api_key(world.a, "one at once", max_in_flight=1)

    class Overloaded(HeldAgent):
        async def receive(self, message: bytes) -> None:
            for frame in unpack_frames(message):
                request, _ = decode_frame(frame)
                error = InferError(request.id, "overloaded", "the batch queue is full")
                self.pool.deliver(self.link, encode_frame(error))

    async def scenario():
        Overloaded(state, version.pk)
        return [(await send("/v2/models/clf/infer", OIP_BODY, raw))[0] for _ in range(3)]

    assert async_to_sync(scenario)() == [503, 503, 503]  # never 429: each gave its place back
    assert state.in_flight.counts == {}


@pytest.mark.django_db
def test_changing_a_keys_limit_is_audited_and_bounded(world):
    from django.core.exceptions import ValidationError

    key = ApiKey.objects.get(tenant=world.a)
    set_key_max_in_flight(key, 5)
    key.refresh_from_db()
    assert key.max_in_flight == 5
    event = AuditEvent.objects.get(action="key.max_in_flight")
    assert (event.before, event.after) == ({"max_in_flight": 64}, {"max_in_flight": 5})
    with pytest.raises(ValidationError):
        set_key_max_in_flight(key, 0)
    key.refresh_from_db()
    assert key.max_in_flight == 5


# OpenAI: shed before the stream starts ---------------------------------------------------------


class SheddingAgent(FakeAgent):
    """Answers every generation with the agent's ``overloaded`` error, as a full agent does."""

    async def stream(self, request: GenerateRequest) -> None:
        error = InferError(request.id, "overloaded", "too many concurrent streams on this agent")
        self.pool.deliver(self.link, encode_frame(error))


def openai_call(key: str, body: dict):
    from django.test import AsyncClient

    async def call():
        response = await AsyncClient().post(
            "/v1/completions",
            body,
            content_type="application/json",
            headers={"Authorization": f"Bearer {key}"},
        )
        assert not response.streaming  # an error is never a stream
        return response

    return call


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_an_overloaded_openai_request_is_503_with_retry_after_before_any_stream(
    world, state, stream
):
    version = make_textgen(make_model(world.a, "writer", task="generator"))

    async def scenario():
        SheddingAgent(state, version.pk)
        body = {"model": "writer", "prompt": "hello", "max_tokens": 5, "stream": stream}
        return await openai_call(world.key_a, body)()

    response = async_to_sync(scenario)()
    assert response.status_code == 503 and response["Retry-After"] == "1"
    error = response.json()["error"]
    assert error["type"] == "server_error" and "too many concurrent streams" in error["message"]
    assert state.in_flight.counts == {}


@pytest.mark.django_db(transaction=True)
def test_an_openai_stream_past_the_keys_in_flight_limit_is_429_in_openais_shape(world, state):
    version = make_textgen(make_model(world.a, "writer", task="generator"))
    _, raw = create_api_key(world.a, "one at once", max_in_flight=1)

    async def scenario():
        FakeAgent(state, version.pk, delay=0.05)
        body = {"model": "writer", "prompt": "a long answer", "max_tokens": 13, "stream": True}
        from django.test import AsyncClient

        first = await AsyncClient().post(
            "/v1/completions",
            body,
            content_type="application/json",
            headers={"Authorization": f"Bearer {raw}"},
        )
        assert first.streaming  # its first token arrived: it holds the key's one place
        second = await openai_call(raw, body)()
        text = "".join([part.decode() async for part in first.streaming_content])
        return first, second, text

    first, second, text = async_to_sync(scenario)()
    assert first.status_code == 200 and text.endswith("data: [DONE]\n\n")
    assert second.status_code == 429 and second["Retry-After"] == "1"
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert state.in_flight.counts == {}


# Websockets: a revoked key stops its streams --------------------------------------------------


@pytest.fixture
def to_revoke(world, settings) -> tuple[ModelVersion, ApiKey, str]:
    """A text generator, and a key of its own to revoke mid-stream, re-checked every 0.1 s."""
    settings.SWITCHYARD_STREAM_KEY_RECHECK_S = 0.1
    version = make_textgen(make_model(world.a, "writer", task="generator"), max_output_tokens=64)
    key, raw = create_api_key(world.a, "to revoke")
    return version, key, raw


async def revoke(state: GatewayState, key: ApiKey) -> None:
    await asyncio.to_thread(revoke_api_key, key)
    state.clear_caches()  # what the refresh loop does once the revocation is seen


@pytest.mark.django_db(transaction=True)
def test_a_revoked_keys_websocket_stops_generating_and_closes(state, to_revoke):
    version, key, raw = to_revoke

    async def scenario():
        agent = FakeAgent(state, version.pk, delay=0.05)  # 40 tokens: 2 s
        async with socket(raw) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "x" * 40})
            await ws.receive_json_from(timeout=5)  # the first token
            await revoke(state, key)
            frames = []
            while True:
                output = await ws.receive_output(timeout=5)
                if output["type"] == "websocket.close":
                    break
                frames.append(json.loads(output["text"]))
        await asyncio.sleep(0.05)
        return agent, frames, output

    agent, frames, closed = async_to_sync(scenario)()
    assert closed["code"] == generate_ws.CLOSE_UNAUTHORIZED
    errors = [f for f in frames if f["type"] == "error"]
    assert errors[0] == {
        "type": "error",
        "id": "g",
        "code": "unauthorized",
        "message": "the API key was revoked",
    }
    tokens = sum(f["type"] == "token" for f in frames)
    assert tokens < 39 and not any(f["type"] == "done" for f in frames)
    assert agent.cancelled == [agent.requests[0].id]  # stopped at the agent, not just here
    assert state.in_flight.counts == {}


@pytest.mark.django_db(transaction=True)
def test_a_new_generate_frame_on_a_revoked_keys_socket_is_refused(state, to_revoke, settings):
    version, key, raw = to_revoke
    settings.SWITCHYARD_STREAM_KEY_RECHECK_S = 60  # only the frame's own check can see it

    async def scenario():
        agent = FakeAgent(state, version.pk)
        async with socket(raw) as ws:
            await ws.send_json_to({"type": "generate", "id": "before", "prompt": "ok"})
            before = await frames_until_end(ws, "before")
            await revoke(state, key)
            await ws.send_json_to({"type": "generate", "id": "after", "prompt": "ok"})
            refused = await ws.receive_json_from(timeout=5)
            closed = await ws.receive_output(timeout=5)
        return agent, before, refused, closed

    agent, before, refused, closed = async_to_sync(scenario)()
    assert before[-1]["type"] == "done" and len(agent.requests) == 1
    assert refused["code"] == "unauthorized" and "revoked" in refused["message"]
    assert closed == {"type": "websocket.close", "code": generate_ws.CLOSE_UNAUTHORIZED}


@pytest.mark.django_db(transaction=True)
def test_a_revoked_keys_openai_stream_ends_with_an_error_event(state, to_revoke):
    version, key, raw = to_revoke

    async def scenario():
        from django.test import AsyncClient

        agent = FakeAgent(state, version.pk, delay=0.05)  # 40 tokens: 2 s
        body = {"model": "writer", "prompt": "x" * 40, "max_tokens": 40, "stream": True}
        response = await AsyncClient().post(
            "/v1/completions",
            body,
            content_type="application/json",
            headers={"Authorization": f"Bearer {raw}"},
        )
        events = aiter(response.streaming_content)
        first = await anext(events)  # the first token
        await revoke(state, key)
        started = asyncio.get_running_loop().time()
        rest = [part.decode() async for part in events]
        ended_after = asyncio.get_running_loop().time() - started
        await asyncio.sleep(0.05)
        return agent, first.decode(), rest, ended_after

    agent, first, rest, ended_after = async_to_sync(scenario)()
    assert '"text": "X"' in first
    payloads = [json.loads(e.removeprefix("data: ")) for e in rest[:-1]]
    assert payloads[-1] == {
        "error": {
            "message": "the API key was revoked",
            "type": "authentication_error",
            "param": None,
            "code": None,
        }
    }
    assert rest[-1] == "data: [DONE]\n\n"
    assert len(payloads) < 39 and ended_after < 1.5  # well before the 2 s the stream would take
    assert agent.cancelled == [agent.requests[0].id]  # stopped at the agent, not just here
    assert state.in_flight.counts == {}


@pytest.mark.django_db
def test_the_admin_sets_a_keys_limit_audited(admin_client, world):
    key = ApiKey.objects.get(tenant=world.a)
    response = admin_client.post(
        f"/admin/tenants/apikey/{key.pk}/change/",
        {"name": key.name, "priority": key.priority, "max_in_flight": 3},
    )
    assert response.status_code == 302
    key.refresh_from_db()
    assert key.max_in_flight == 3
    assert AuditEvent.objects.get(action="key.max_in_flight").after == {"max_in_flight": 3}


@pytest.mark.django_db
def test_grpc_past_the_keys_in_flight_limit_is_resource_exhausted(site):  # noqa: F811
    import grpc
    import tritonclient.grpc.service_pb2_grpc as triton_grpc

    _, raw = create_api_key(site_tenant(site), "one at once", max_in_flight=1)

    async def scenario(address: str):
        agent = HeldAgent(site.state, site.version_id)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = triton_grpc.GRPCInferenceServiceStub(channel)
            held = asyncio.ensure_future(stub.ModelInfer(infer_request(X), metadata=bearer(raw)))
            while not agent.held:
                await asyncio.sleep(0.01)
            try:
                await stub.ModelInfer(infer_request(X), metadata=bearer(raw))
            except grpc.aio.AioRpcError as error:
                refused = error
            else:
                raise AssertionError("the second call was not limited")
            agent.answer_all()
            return await held, refused

    answered, refused = serve(site, scenario, agent=False)
    assert list(answered.outputs[0].shape) == [2, 2]
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many requests in flight for this API key" in refused.details()
    assert dict(refused.trailing_metadata())["retry-after"] == "1"


def site_tenant(grpc_site):
    from registry.models import ModelVersion

    return ModelVersion.objects.get(pk=grpc_site.version_id).model.tenant
