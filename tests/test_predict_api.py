"""The prediction API (``POST /api/v1/models/{name}/predict``) through the real ASGI application
(platform_site.asgi): answers, every error status in the API's shape, hostile bodies, tenant
isolation, load shedding with Retry-After, and agreement with the schema and the DRF view.

The agent here is an in-process link that speaks the agent's frame protocol and runs ONNX
Runtime on the version's artifact; the real processes are in tests/e2e/test_predictions.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort
import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.test import AsyncClient
from rest_framework.test import APIClient

from gateway import state as state_module
from gateway.api import predict_app, views
from gateway.api.serializers import PredictRequest, PredictResponse
from gateway.dispatch import AgentLink
from gateway.state import GatewayState
from platform_site.asgi import application
from serving_agent._serving import result_frame
from serving_agent.protocol import (
    BATCH,
    INTERACTIVE,
    SHADOW,
    InferRequest,
    decode_frame,
    error_frame,
    unpack_frames,
)
from tests.factories import make_key, make_model, make_tenant, make_version

pytestmark = pytest.mark.django_db

FEATURES = ["amount", "hour", "risk", "age"]
URL = "/api/v1/models/clf/predict"


class OnnxAgent:
    """A link in the pool that answers requests with ONNX Runtime on the version's artifact, as
    a serving agent does (the agent's own frame encoding); or answers ``overloaded``."""

    def __init__(self, state: GatewayState, version_id: int, artifact: bytes):
        self.pool = state.pool
        self.session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
        self.overloaded = False
        self.requests: list[InferRequest] = []
        self.link = AgentLink("onnx", self.receive)
        self.pool.add(self.link)
        self.pool.set_ready(self.link, version_id, True)

    async def receive(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            request, arrays = decode_frame(frame)
            assert isinstance(request, InferRequest)
            self.requests.append(request)
            if self.overloaded:
                reply = error_frame(request.id, "overloaded", "the batch queue is full")
            else:
                feeds = {t.name: a for t, a in zip(request.inputs, arrays, strict=True)}
                names = [o.name for o in self.session.get_outputs()]
                try:
                    for name, array in feeds.items():
                        if array.dtype.kind == "O":  # BYTES: ORT's string tensors take str
                            feeds[name] = np.vectorize(bytes.decode, otypes=[object])(array)
                except UnicodeDecodeError:
                    reply = error_frame(request.id, "bad_input", "not valid UTF-8 text")
                else:
                    reply = result_frame(request.id, names, self.session.run(None, feeds))
            self.pool.deliver(self.link, reply)


@pytest.fixture
def state(monkeypatch, settings) -> GatewayState:
    settings.SWITCHYARD_MAX_BODY_BYTES = 8 * 1024 * 1024
    gateway = GatewayState()
    monkeypatch.setattr(predict_app, "get_state", lambda: gateway)
    monkeypatch.setattr(views, "get_state", lambda: gateway)
    monkeypatch.setattr(state_module, "get_state", lambda: gateway)
    return gateway


@pytest.fixture
def served(world, state, onnx_bytes):
    """Tenant A's ``clf`` (named features) in production, answered by an ONNX agent."""
    version = make_version(make_model(world.a, "clf"), onnx_bytes, feature_names=FEATURES)
    world.agent = OnnxAgent(state, version.pk, onnx_bytes)
    world.version = version
    return world


@dataclass
class Call:
    """One request to the ASGI application."""

    body: bytes | dict | list
    key: str | None = None
    path: str = URL
    content_type: str | None = "application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    method: str = "POST"


Reply = tuple[int, dict[str, str], dict]


async def send(call: Call) -> Reply:
    raw = call.body if isinstance(call.body, bytes) else json.dumps(call.body).encode()
    sent = list(call.headers)
    if call.key is not None:
        sent.append((b"authorization", f"Bearer {call.key}".encode()))
    if call.content_type is not None:
        sent.append((b"content-type", call.content_type.encode()))
    communicator = HttpCommunicator(application, call.method, call.path, body=raw, headers=sent)
    response = await communicator.get_response(timeout=10)
    got = {k.decode().lower(): v.decode() for k, v in response["headers"]}
    return response["status"], got, json.loads(response["body"])


def calls(*requests: Call) -> list[Reply]:
    """The replies to ``requests``, sent one after the other on one event loop (as a server
    has: the Redis limiter's connections belong to the loop that opened them)."""

    async def scenario() -> list[Reply]:
        return [await send(call) for call in requests]

    return async_to_sync(scenario)()


def post(body: bytes | dict | list, key: str | None = None, **details) -> Reply:
    return calls(Call(body, key, **details))[0]


def expected(artifact: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


# Answers --------------------------------------------------------------------------------------


def test_named_features_rows_and_columns_all_get_the_models_answer(served, onnx_bytes, rng):
    x = rng.normal(size=(3, 4)).astype(np.float32)
    want = expected(onnx_bytes, x)
    named = [dict(zip(FEATURES, row, strict=True)) for row in x.tolist()]
    bodies = [{"instances": named}, {"instances": x.tolist()}, {"inputs": {"x": x.tolist()}}]
    replies = calls(
        *(Call(body, served.key_a) for body in bodies),
        Call({"instances": x.tolist()}, served.key_a, "/api/v1/models/clf/versions/1/predict"),
    )
    for status, headers, answer in replies[:3]:
        assert status == 200, answer
        assert (answer["model"], answer["version"]) == ("clf", 1)
        np.testing.assert_allclose(answer["predictions"], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(answer["outputs"]["y"], want, rtol=1e-5, atol=1e-6)
        assert headers["content-type"] == "application/json"
        assert headers["traceparent"].startswith("00-") and headers["x-request-id"]
    by_version = replies[3]
    assert by_version[0] == 200 and by_version[2]["version"] == 1


def test_the_callers_request_id_and_charset_are_kept(served):
    row = {"instances": [[0.1, 0.2, 0.3, 0.4]]}
    kept, refused = calls(
        Call(
            row,
            served.key_a,
            content_type="application/json; charset=utf-8",
            headers=[(b"x-request-id", b"order-17")],
        ),
        Call(row, served.key_a, headers=[(b"x-request-id", b"no spaces allowed")]),
    )
    assert kept[0] == 200 and kept[1]["x-request-id"] == "order-17"
    assert refused[0] == 400 and "x-request-id" in refused[2]["error"]


def test_a_body_without_a_content_type_is_read_as_json(served):
    status, _, _ = post({"instances": [[0.1, 0.2, 0.3, 0.4]]}, served.key_a, content_type=None)
    assert status == 200


# Errors ---------------------------------------------------------------------------------------


def test_missing_and_invalid_keys_get_401_with_www_authenticate(served):
    row = {"instances": [[0.1, 0.2, 0.3, 0.4]]}
    (status, headers, body), unknown = calls(Call(row), Call(row, "sy_deadbeef_nope"))
    assert status == 401 and "missing API key" in body["error"]
    assert headers["www-authenticate"] == "Bearer"
    assert unknown[0] == 401 and "invalid or revoked" in unknown[2]["error"]


def test_other_tenant_gets_404_and_so_do_unknown_models_and_versions(served):
    row = {"instances": [[0.1, 0.2, 0.3, 0.4]]}
    replies = calls(
        Call(row, served.key_b),
        Call(row, served.key_b, "/api/v1/models/clf/versions/1/predict"),
        Call(row, served.key_a, "/api/v1/models/nope/predict"),
        Call(row, served.key_a, "/api/v1/models/clf/versions/9/predict"),
    )
    assert [status for status, _, _ in replies] == [404] * 4
    assert "not found" in replies[0][2]["error"]  # as for a model that does not exist
    assert served.agent.requests == []


def test_a_body_over_the_limit_gets_413(served):
    status, _, body = post(b"[" + b"0," * (5 * 1024 * 1024) + b"0]", served.key_a)
    assert status == 413 and "larger than the limit" in body["error"]


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_body_that_is_not_json_gets_415(served, content_type):
    status, _, body = post(b"instances=1", served.key_a, content_type=content_type)
    assert status == 415 and "application/json" in body["error"]
    assert content_type in body["error"]


def test_another_method_is_answered_by_drf_with_405(served):
    host = [(b"host", b"localhost")]  # Django checks it (the lean app needs no Host)
    status, headers, body = post(b"", served.key_a, method="GET", headers=host)
    assert status == 405 and "POST" in headers["allow"]
    assert "GET" in body["error"]


@pytest.mark.parametrize(
    "body, words",
    [
        (b"{", "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"instances": ["\xff\xfe"]}', "not valid JSON"),  # not UTF-8
        (b'{"instances": [[1e400, 0, 0, 0]]}', "not valid JSON"),  # no double holds it
        (b'{"instances": [[NaN, 0, 0, 0]]}', "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "not valid JSON"),  # nested past the parser's depth
        (b'{"instances": ' + b"[" * 500 + b"1" + b"]" * 500 + b"}", "not FP32"),
        (b'{"instances": [[[0, 0, 0, 0]]]}', "does not match"),
        (b'{"instances": [[1e39, 0, 0, 0]]}', "NaN or infinity"),  # past float32
        (b'{"instances": [[' + b"9" * 300 + b", 0, 0, 0]]}", "NaN or infinity"),
        (b"[1, 2]", "Expected a dictionary"),
        (b"null", "may not be null"),
        (b'{"instances": "abc"}', "instances: Expected a list"),
        (b'{"inputs": [1, 2]}', "inputs: Expected a dictionary"),
        (b'{"outputs": [[1]], "instances": [[0, 0, 0, 0]]}', "outputs"),
        (b'{"instances": [["a", "b", "c", "d"]]}', "not FP32"),
        (b'{"instances": [{"amount": 1}]}', "missing feature"),
        (b'{"instances": [{"amount": 1, "hour": 1, "risk": 1, "age": 1, "x": 2}]}', "unknown"),
        (b'{"instances": []}', "non-empty"),
        (b'{"instances": [[0, 0, 0, 0]], "inputs": {"x": [[0, 0, 0, 0]]}}', "exactly one"),
        (b'{"inputs": {"x": [[0, 0, 0]]}}', "does not match"),
        (b'{"inputs": {"z": [[0, 0, 0, 0]]}}', "unknown input"),
        (b'{"outputs": ["nope"], "instances": [[0, 0, 0, 0]]}', "output names"),
    ],
)
def test_hostile_and_wrong_bodies_get_400_naming_the_problem(served, body, words):
    status, _, answer = post(body, served.key_a)
    assert status == 400, answer
    assert words in answer["error"]
    assert served.agent.requests == []  # refused before anything reached the agent


def test_a_serializer_error_names_its_field_as_the_api_does(served):
    status, _, body = post({"instances": "abc"}, served.key_a)
    assert status == 400 and set(body["fields"]) == {"instances"}


# Load shedding --------------------------------------------------------------------------------


def test_a_tenant_past_its_rate_limit_gets_429_with_retry_after(served, state, onnx_bytes):
    slow = make_tenant("slow", rps=1, burst=2)
    version = make_version(make_model(slow, "clf"), onnx_bytes)
    state.pool.set_ready(served.agent.link, version.pk, True)
    key = make_key(slow)[1]
    answers = calls(*[Call({"instances": [[0, 0, 0, 0]]}, key)] * 6)
    statuses = [status for status, _, _ in answers]
    assert statuses[0] == 200 and 429 in statuses, statuses
    status, headers, body = next(a for a in answers if a[0] == 429)
    assert int(headers["retry-after"]) >= 1 and "rate limit exceeded" in body["error"]


def test_an_overloaded_agent_sheds_with_503_and_retry_after(served):
    served.agent.overloaded = True
    status, headers, body = post({"instances": [[0, 0, 0, 0]]}, served.key_a)
    assert status == 503 and headers["retry-after"] == "1"
    assert "overloaded" in body["error"]


def test_no_ready_agent_is_503_with_retry_after(served, state):
    state.pool.set_ready(served.agent.link, served.version.pk, False)
    status, headers, body = post({"instances": [[0, 0, 0, 0]]}, served.key_a)
    assert status == 503 and headers["retry-after"] == "1"
    assert "no serving agent" in body["error"]


# One definition ------------------------------------------------------------------------------


def test_the_schema_documents_what_the_lean_app_validates_and_answers(served):
    assert isinstance(predict_app.REQUEST, PredictRequest)
    client = APIClient(HTTP_AUTHORIZATION=f"Bearer {served.key_a}")
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    operation = schema["paths"]["/api/v1/models/{name}/predict"]["post"]
    request = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert request.endswith("/PredictRequest")
    documented = {"200", "400", "401", "404", "413", "415", "429", "503"}
    assert documented <= set(operation["responses"])
    assert operation["security"] == [{"apiKey": []}]  # required: no anonymous entry
    response = schema["components"]["schemas"]["PredictResponse"]
    _, _, answer = post({"instances": [[0, 0, 0, 0]]}, served.key_a)
    optional = {"arm", "class_labels"}  # while a plan routes; a classifier's ZipMap labels
    assert set(answer) == set(response["properties"]) - optional
    assert set(answer) == set(PredictResponse().fields) - optional
    assert set(response["required"]) <= set(answer)


@pytest.mark.django_db(transaction=True)  # the test client closes connections between calls
def test_the_drf_view_answers_as_the_lean_app_does(served):
    """A request that reaches Django (its async test client, which skips the ASGI router)
    gets the same answer from ``PredictView``."""
    row = {"instances": [[0.5, -1.0, 2.0, 0.25]]}

    async def through_django(key: str):
        return await AsyncClient().post(
            URL, row, content_type="application/json", headers={"Authorization": f"Bearer {key}"}
        )

    async def scenario():
        lean = await send(Call(row, served.key_a))
        return lean, await through_django(served.key_a), await through_django(served.key_b)

    (status, _, lean), answered, refused = async_to_sync(scenario)()
    assert answered.status_code == status == 200, answered.content
    assert answered.json() == lean
    assert answered["x-request-id"] and answered["traceparent"]
    assert refused.status_code == 404 and "not found" in refused.json()["error"]


def test_the_keys_class_and_a_shorter_deadline_travel_to_the_agent(served, state):
    row = {"instances": [[0.1, 0.2, 0.3, 0.4]]}
    plain, short, bad = calls(
        Call(row, served.key_a),
        Call(row, served.key_a, headers=[(b"x-switchyard-timeout-ms", b"250")]),
        Call(row, served.key_a, headers=[(b"x-switchyard-timeout-ms", b"soon")]),
    )
    assert plain[0] == short[0] == 200
    assert bad[0] == 400 and "x-switchyard-timeout-ms" in bad[2]["error"]
    first, second = served.agent.requests
    assert first.priority == second.priority == INTERACTIVE  # the key's class
    assert first.budget_ms == state.infer_timeout * 1000 and second.budget_ms == 250.0
    assert first.tenant == served.a.pk and first.key  # whose request it is, for fairness


# Scheduling parameters ------------------------------------------------------------------------

ROW = [[0.1, 0.2, 0.3, 0.4]]


def test_parameters_schedule_the_request_as_on_oip(served, state):
    replies = calls(
        Call(
            {"instances": ROW, "parameters": {"priority": "batch", "timeout": 250_000}},
            served.key_a,
        ),
        Call({"instances": ROW, "parameters": {"priority": 4}}, served.key_a),  # Triton's
        Call(
            {"inputs": {"x": ROW}, "parameters": {"timeout": 2_000_000, "priority": None}},
            served.key_a,
            headers=[(b"x-switchyard-timeout-ms", b"40")],  # the shorter of both
        ),
        Call({"instances": ROW, "parameters": {}}, served.key_a),
    )
    assert [status for status, _, _ in replies] == [200] * 4, replies
    scheduled = [(r.priority, r.budget_ms) for r in served.agent.requests]
    server = state.infer_timeout * 1000
    assert scheduled == [
        (BATCH, 250.0),
        (SHADOW, server),
        (INTERACTIVE, 40.0),
        (INTERACTIVE, server),
    ]


def test_a_priority_above_the_keys_ceiling_is_a_403(served):
    _, nightly = make_key(served.a, "nightly", priority=BATCH)
    refused, allowed = calls(
        Call({"instances": ROW, "parameters": {"priority": "interactive"}}, nightly),
        Call({"instances": ROW, "parameters": {"priority": "shadow"}}, nightly),
    )
    assert refused[0] == 403
    assert refused[2]["error"] == (
        "parameters.priority: 'interactive' is above what this API key may ask for ('batch')"
    )
    assert allowed[0] == 200
    assert [r.priority for r in served.agent.requests] == [SHADOW]


@pytest.mark.parametrize(
    "parameters, words",
    [
        ([1], "parameters: Invalid data. Expected a dictionary"),
        ("batch", "parameters: Invalid data. Expected a dictionary"),
        (
            {"timeout_ms": 5},
            "parameters.timeout_ms: unknown parameter; send only priority, timeout",
        ),
        ({"priority": "asap"}, "parameters.priority: must be one of critical, interactive"),
        ({"priority": True}, "parameters.priority: must be one of"),
        ({"priority": 5}, "parameters.priority: must be one of"),
        ({"timeout": "100"}, "parameters.timeout: must be a positive number of microseconds"),
        ({"timeout": -1}, "parameters.timeout: must be a positive number of microseconds"),
        ({"timeout": [1]}, "parameters.timeout: must be a positive number of microseconds"),
    ],
)
def test_bad_parameters_are_a_400_naming_the_parameter(served, parameters, words):
    status, _, answer = post({"instances": ROW, "parameters": parameters}, served.key_a)
    assert status == 400, answer
    assert answer["error"].startswith(words), answer
    assert served.agent.requests == []  # refused before anything reached the agent


@pytest.mark.django_db(transaction=True)  # the test client closes connections between calls
def test_the_drf_view_reads_parameters_as_the_lean_app_does(served, state):
    _, nightly = make_key(served.a, "nightly", priority=BATCH)

    async def through_django(key: str, parameters: object):
        reply = await AsyncClient().post(
            URL,
            {"instances": ROW, "parameters": parameters},
            content_type="application/json",
            headers={"Authorization": f"Bearer {key}"},
        )
        return reply.status_code, reply.json()

    async def scenario():
        return [
            await through_django(served.key_a, {"timeout": 125_000}),
            await through_django(nightly, {"priority": "critical"}),
            await through_django(served.key_a, {"deadline": 1}),
        ]

    timed, above, unknown = async_to_sync(scenario)()
    assert timed[0] == 200, timed
    assert [r.budget_ms for r in served.agent.requests] == [125.0]
    assert above[0] == 403 and above[1]["error"].startswith("parameters.priority: 'critical'")
    assert unknown[0] == 400 and unknown[1]["error"].startswith("parameters.deadline: unknown")


def test_the_schema_documents_the_parameters(served):
    client = APIClient(HTTP_AUTHORIZATION=f"Bearer {served.key_a}")
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    operation = schema["paths"]["/api/v1/models/{name}/predict"]["post"]
    assert "403" in operation["responses"]
    request = schema["components"]["schemas"]["PredictRequest"]["properties"]["parameters"]
    parameters = schema["components"]["schemas"][request["$ref"].rsplit("/", 1)[1]]
    assert set(parameters["properties"]) == {"priority", "timeout"}
    priority = parameters["properties"]["priority"]
    assert {"type": "string", "enum": ["critical", "interactive", "batch", "shadow"]} in (
        priority["oneOf"]
    )
    assert "microseconds" in parameters["properties"]["timeout"]["description"]
