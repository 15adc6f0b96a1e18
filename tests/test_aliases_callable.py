"""Every alias is callable on every front door, through that alias's own rollout plan.

Before, only ``production`` could be addressed: ``/versions/staging`` was a 400, and a plan on
another alias was accepted and never routed. Here a ``staging`` alias answers on OIP REST and
gRPC, the prediction API, OpenAI (``model@alias``) and the generation websocket; a canary on
``staging`` splits staging's traffic and leaves production alone; an unknown alias is a 404
naming it, a malformed one a 400; another tenant's alias is not found; a warm alias request
asks the database nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import grpc
import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.core.exceptions import ValidationError
from django.db import connections
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc import service_pb2_grpc as triton_grpc

from gateway import generate_ws, grpc_server, oip, openai_api
from gateway import state as state_module
from gateway.admission import model_ref, parse_version
from gateway.api import predict_app, views
from gateway.dispatch import AgentLink
from gateway.errors import ApiError
from gateway.state import GatewayState
from platform_site.asgi import application
from registry.services import set_alias
from rollouts.actions import start_plan
from serving_agent._serving import result_frame
from serving_agent.protocol import InferRequest, decode_frame, unpack_frames
from tenants.audit import Actor
from tests.factories import make_model, make_version
from tests.test_generation import FakeAgent, frames_until_end, make_textgen, socket

FEATURES = ["amount", "hour", "risk", "age"]
OIP_BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]}
PREDICT_BODY = {"instances": [[0, 0, 0, 0]]}
GUARDRAILS = {"max_error_rate_increase": 0.05, "max_p99_ratio": 2.0, "min_samples": 100}


class VersionAgent:
    """An agent link serving every given version; each answer is filled with the number of
    the version that computed it, so a test sees which version answered."""

    def __init__(self, state: GatewayState, numbers: dict[int, int]) -> None:
        self.pool = state.pool
        self.numbers = numbers  # version id -> version number
        self.link = AgentLink("versions", self.receive)
        self.pool.add(self.link)
        for version_id in numbers:
            self.pool.set_ready(self.link, version_id, True)

    async def receive(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            request, arrays = decode_frame(frame)
            assert isinstance(request, InferRequest)
            out = np.full((len(arrays[0]), 2), self.numbers[request.version_id], np.float32)
            self.pool.deliver(self.link, result_frame(request.id, ["y"], [out]))


class Site:
    def __init__(self, world, onnx_bytes) -> None:
        self.world = world
        self.model = make_model(world.a, "clf")
        self.v1 = make_version(self.model, onnx_bytes, "production", feature_names=FEATURES)
        self.v2 = make_version(self.model, onnx_bytes, "staging", feature_names=FEATURES)
        self.v3 = make_version(self.model, onnx_bytes, None, feature_names=FEATURES)
        # Beta has a model of the same name with its own staging alias.
        theirs = make_model(world.b, "clf")
        make_version(theirs, onnx_bytes, "production", feature_names=FEATURES)
        self.numbers = {v.pk: v.version for v in (self.v1, self.v2, self.v3)}


@pytest.fixture
def state(monkeypatch) -> GatewayState:
    gateway = GatewayState()
    for module in (predict_app, views, state_module, oip, grpc_server):
        monkeypatch.setattr(module, "get_state", lambda: gateway)
    return gateway


@pytest.fixture
def site(world, onnx_bytes) -> Site:
    return Site(world, onnx_bytes)


async def post(path: str, body: dict, key: str, user: str | None = None):
    headers = [
        (b"authorization", f"Bearer {key}".encode()),
        (b"content-type", b"application/json"),
    ]
    if user is not None:
        headers.append((b"x-user-id", user.encode()))
    communicator = HttpCommunicator(
        application, "POST", path, body=json.dumps(body).encode(), headers=headers
    )
    response = await communicator.get_response(timeout=10)
    return response["status"], json.loads(response["body"])


async def get(path: str, key: str):
    headers = [(b"authorization", f"Bearer {key}".encode())]
    response = await HttpCommunicator(application, "GET", path, headers=headers).get_response(
        timeout=10
    )
    return response["status"], json.loads(response["body"])


def answered_by(status: int, body: dict) -> int:
    """The version number that computed an OIP answer (see VersionAgent)."""
    assert status == 200, body
    return int(body["outputs"][0]["data"][0])


# The rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "segment, target",
    [
        (None, "production"),
        ("", "production"),
        ("3", 3),
        ("staging", "staging"),
        ("b2.x_y-z", "b2.x_y-z"),
    ],
)
def test_a_version_segment_is_a_number_or_an_alias(segment, target):
    assert parse_version(segment) == target


@pytest.mark.parametrize(
    "segment", ["0", "Staging", "-x", "a b", "x" * 51, "a/b", "ｓtaging", "a\n"]
)
def test_a_malformed_version_segment_is_a_400_naming_it(segment):
    with pytest.raises(ApiError) as caught:
        parse_version(segment)
    assert caught.value.status == 400
    assert "version must be a positive integer" in caught.value.message


def test_model_refs_split_at_the_at_sign():
    assert model_ref("writer") == ("writer", None)
    assert model_ref("writer@staging") == ("writer", "staging")
    assert model_ref("writer@3") == ("writer", "3")


@pytest.mark.django_db
def test_an_alias_of_only_digits_is_refused_it_would_read_as_a_version(site):
    with pytest.raises(ValidationError):
        set_alias(site.model, "2", site.v1)
    assert not site.model.aliases.filter(name="2").exists()


# OIP REST and the prediction API ------------------------------------------------------------


@pytest.mark.django_db
def test_staging_answers_on_oip_and_the_prediction_api(site, state):
    async def scenario():
        VersionAgent(state, site.numbers)
        key = site.world.key_a
        return (
            await post("/v2/models/clf/versions/staging/infer", OIP_BODY, key),
            await post("/v2/models/clf/infer", OIP_BODY, key),
            await post("/v2/models/clf/versions/3/infer", OIP_BODY, key),
            await post("/api/v1/models/clf/versions/staging/predict", PREDICT_BODY, key),
            await post("/api/v1/models/clf/predict", PREDICT_BODY, key),
            await get("/v2/models/clf/versions/staging", key),
        )

    staging, production, number, api_staging, api_production, meta = async_to_sync(scenario)()
    assert answered_by(*staging) == 2 and staging[1]["model_version"] == "2"
    assert answered_by(*production) == 1
    assert answered_by(*number) == 3
    assert api_staging[0] == 200 and api_staging[1]["version"] == 2
    assert api_production[0] == 200 and api_production[1]["version"] == 1
    assert meta == (200, {**meta[1], "versions": ["2"]})


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v2/models/clf/versions/{}/infer", OIP_BODY),
        ("/api/v1/models/clf/versions/{}/predict", PREDICT_BODY),
    ],
    ids=["oip", "prediction-api"],
)
def test_unknown_alias_is_404_naming_it_and_a_bad_one_400(site, state, path, body):
    async def scenario():
        VersionAgent(state, site.numbers)
        key = site.world.key_a
        return (
            await post(path.format("canary"), body, key),
            await post(path.format("Staging"), body, key),
            await post(path.format("0"), body, key),
        )

    unknown, upper, zero = async_to_sync(scenario)()
    assert unknown == (404, {"error": "model 'clf' has no alias 'canary'"})
    assert upper[0] == 400 and "'Staging'" in upper[1]["error"]
    assert zero[0] == 400 and "positive integer" in zero[1]["error"]


@pytest.mark.django_db
def test_another_tenants_alias_is_not_found(site, state):
    async def scenario():
        VersionAgent(state, site.numbers)
        # Beta's clf has no staging alias; alpha's does, and beta's key must not reach it.
        return await post("/v2/models/clf/versions/staging/infer", OIP_BODY, site.world.key_b)

    assert async_to_sync(scenario)() == (404, {"error": "model 'clf' has no alias 'staging'"})


@pytest.mark.django_db
def test_a_canary_on_staging_splits_staging_and_leaves_production_alone(site, state):
    engineer = Actor(site.world.engineer_a.pk, "eng-a", "engineer")
    start_plan(site.model, "canary", site.v3, GUARDRAILS, engineer, alias="staging", weight=50)

    async def scenario():
        VersionAgent(state, site.numbers)
        key = site.world.key_a
        staging, production = Counter(), Counter()
        for i in range(200):
            user = f"user-{i}"
            got = await post("/v2/models/clf/versions/staging/infer", OIP_BODY, key, user)
            staging[answered_by(*got)] += 1
            production[answered_by(*await post("/v2/models/clf/infer", OIP_BODY, key, user))] += 1
        # Sticky: the same user gets the same arm again.
        again = [
            answered_by(*await post("/v2/models/clf/versions/staging/infer", OIP_BODY, key, u))
            for u in ("user-1", "user-1", "user-1")
        ]
        return staging, production, again

    staging, production, again = async_to_sync(scenario)()
    assert set(staging) == {2, 3} and 60 <= staging[3] <= 140  # about half of 200
    assert production == {1: 200}
    assert len(set(again)) == 1


@pytest.mark.django_db
def test_a_warm_alias_request_asks_the_database_nothing(site, state, monkeypatch):
    calls: Counter[str] = Counter()
    for name in ("resolve_route", "active_split", "resolve_version_id"):
        real = getattr(state_module, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(state_module, name, counted)

    async def scenario():
        VersionAgent(state, site.numbers)
        key = site.world.key_a
        await post("/v2/models/clf/versions/staging/infer", OIP_BODY, key)
        cold = dict(calls)
        for _ in range(5):
            await post("/v2/models/clf/versions/staging/infer", OIP_BODY, key)
        return cold

    cold = async_to_sync(scenario)()
    assert cold == {"resolve_route": 1, "active_split": 1}
    assert dict(calls) == cold  # the five warm requests were served from the caches


@pytest.mark.django_db
def test_the_caches_are_keyed_by_alias_and_dropped_on_a_change(site, state):
    async def scenario():
        VersionAgent(state, site.numbers)
        key = site.world.key_a
        first = answered_by(*await post("/v2/models/clf/versions/staging/infer", OIP_BODY, key))
        await asyncio.to_thread(lambda: None)
        return first

    assert async_to_sync(scenario)() == 2
    assert (site.world.a.pk, "clf", "staging") in state._routes
    assert (site.world.a.pk, "clf", "staging") in state._splits
    set_alias(site.model, "staging", site.v3)
    state.clear_caches()  # what the refresh loop does when the config generation moves

    async def again():
        return answered_by(
            *await post("/v2/models/clf/versions/staging/infer", OIP_BODY, site.world.key_a)
        )

    assert async_to_sync(again)() == 3


# gRPC ------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.db_threads
def test_staging_answers_on_grpc_and_bad_or_unknown_aliases_are_refused(
    world, onnx_bytes, monkeypatch
):
    # The handlers run in gRPC's own tasks, so the gateway's database calls use its threads.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    site = Site(world, onnx_bytes)

    async def scenario():
        state = GatewayState()
        monkeypatch.setattr(grpc_server, "get_state", lambda: state)
        VersionAgent(state, site.numbers)
        server, port = await grpc_server.start_server("127.0.0.1", 0, 1 << 20)
        metadata = [("authorization", f"Bearer {world.key_a}")]
        results = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = triton_grpc.GRPCInferenceServiceStub(channel)
                for version in ("staging", "", "Bad!", "nope"):
                    request = triton_pb.ModelInferRequest(model_name="clf", model_version=version)
                    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
                    request.raw_input_contents.append(np.zeros((1, 4), np.float32).tobytes())
                    try:
                        reply = await stub.ModelInfer(request, metadata=metadata)
                        out = np.frombuffer(reply.raw_output_contents[0], np.float32)
                        results[version] = (reply.model_version, int(out[0]))
                    except grpc.aio.AioRpcError as error:
                        results[version] = (error.code(), error.details())
        finally:
            await server.stop(None)
        return results

    results = async_to_sync(scenario)()
    assert results["staging"] == ("2", 2)
    assert results[""] == ("1", 1)
    assert results["Bad!"][0] is grpc.StatusCode.INVALID_ARGUMENT
    assert "'Bad!'" in results["Bad!"][1]
    assert results["nope"] == (grpc.StatusCode.NOT_FOUND, "model 'clf' has no alias 'nope'")


# OpenAI and the generation websocket ------------------------------------------------------


@pytest.fixture
def writers(world, monkeypatch):
    """A text model with v1 on production and v2 on staging, and one gateway state for both
    doors."""
    model = make_model(world.a, "writer", task="generator")
    world.v1 = make_textgen(model, "production")
    world.v2 = make_textgen(model, "staging")
    state = GatewayState()
    monkeypatch.setattr(generate_ws, "get_state", lambda: state)
    monkeypatch.setattr(openai_api, "get_state", lambda: state)
    world.state = state
    return world


def openai(key: str, path: str, body: dict | None = None):
    from django.test import AsyncClient

    async def call():
        auth = {"Authorization": f"Bearer {key}"}
        if body is None:
            response = await AsyncClient().get(path, headers=auth)
        else:
            response = await AsyncClient().post(
                path, body, content_type="application/json", headers=auth
            )
        return response.status_code, response.json(), response.headers

    return call


@pytest.mark.django_db(transaction=True)
@pytest.mark.backends
def test_staging_answers_on_openai_and_the_generation_websocket(writers):
    async def scenario():
        FakeAgent(writers.state, writers.v1.pk)
        FakeAgent(writers.state, writers.v2.pk)
        body = {"model": "writer@staging", "prompt": "hi", "max_tokens": 8}
        completion = await openai(writers.key_a, "/v1/completions", body)()
        unknown = await openai(writers.key_a, "/v1/completions", {**body, "model": "writer@x"})()
        bad = await openai(writers.key_a, "/v1/completions", {**body, "model": "writer@X"})()
        other = await openai(writers.key_b, "/v1/completions", body)()
        listing = await openai(writers.key_a, "/v1/models")()
        async with socket(writers.key_a, "writer@staging") as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "hi", "max_tokens": 4})
            frames = await frames_until_end(ws, "g")
        async with socket(writers.key_a, "writer") as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "hi", "max_tokens": 4})
            production = await frames_until_end(ws, "g")
        return completion, unknown, bad, other, listing, frames, production

    completion, unknown, bad, other, listing, frames, production = async_to_sync(scenario)()
    status, answer, headers = completion
    assert status == 200 and headers["x-switchyard-version"] == "2"
    assert answer["choices"][0]["text"] == "HI"
    assert unknown[0] == 404 and "no alias 'x'" in unknown[1]["error"]["message"]
    assert bad[0] == 400 and "'X'" in bad[1]["error"]["message"]
    assert other[0] == 404  # beta has no model "writer"
    ids = [m["id"] for m in listing[1]["data"]]
    assert ids == ["writer", "writer@staging"]
    assert frames[-1]["type"] == "done" and frames[-1]["version"] == 2
    assert production[-1]["type"] == "done" and production[-1]["version"] == 1
