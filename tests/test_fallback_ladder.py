"""Degrading instead of failing, through the real ASGI application (OIP v2 REST): a model's
fallback ladder (its version → its fallback version → its default answer, each step with its
own timeout), circuit breakers per version and per agent link, and one retry on another replica
for a request no agent started. The agents are in-process links that speak the agent's frame
protocol and run ONNX Runtime, or fail as the test tells them to; the real processes are in
tests/e2e/test_resilience_drills.py."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import onnxruntime as ort
import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from rest_framework.test import APIClient

from gateway import oip
from gateway import state as state_module
from gateway.breakers import CLOSED, HALF_OPEN, OPEN, Breaker
from gateway.dispatch import AgentLink
from gateway.state import GatewayState
from monitoring.models import TrafficSample
from monitoring.slo import model_slos
from monitoring.traffic import NO_PLAN, save_samples
from platform_site.asgi import application
from registry.models import Model
from registry.services import served_versions, set_alias
from serving_agent._serving import result_frame
from serving_agent.protocol import InferRequest, decode_frame, error_frame, unpack_frames
from tenants.models import AuditEvent
from tests.factories import make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.django_db

URL = "/v2/models/clf/infer"


class Agent:
    """An agent link in the pool serving one version. ``mode``: "ok" answers with ONNX
    Runtime, "error" with the agent's internal error (a 500), "overloaded" refuses unstarted,
    "silent" never answers, "unreachable" fails the send as a closed socket does."""

    def __init__(self, state: GatewayState, version_id: int, artifact: bytes, name: str = "a"):
        self.pool = state.pool
        self.session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
        self.mode = "ok"
        self.requests: list[InferRequest] = []
        self.link = AgentLink(name, self.receive)
        self.pool.add(self.link)
        self.pool.set_ready(self.link, version_id, True)

    async def receive(self, message: bytes) -> None:
        if self.mode == "unreachable":
            raise ConnectionResetError("the agent's socket is closed")
        for frame in unpack_frames(message):
            request, arrays = decode_frame(frame)
            if not isinstance(request, InferRequest):
                continue  # a cancel frame
            self.requests.append(request)
            if self.mode == "silent":
                continue
            if self.mode == "error":
                reply = error_frame(request.id, "internal", "onnxruntime raised")
            elif self.mode == "overloaded":
                reply = error_frame(request.id, "overloaded", "the batch queue is full")
            else:
                feeds = {t.name: a for t, a in zip(request.inputs, arrays, strict=True)}
                names = [o.name for o in self.session.get_outputs()]
                reply = result_frame(request.id, names, self.session.run(None, feeds))
            self.pool.deliver(self.link, reply)


@pytest.fixture
def state(monkeypatch, settings) -> GatewayState:
    settings.SWITCHYARD_BREAKER_FAILURES = 3
    settings.SWITCHYARD_BREAKER_COOLDOWN_S = 0.3
    settings.SWITCHYARD_INFER_TIMEOUT_S = 2
    gateway = GatewayState()
    monkeypatch.setattr(oip, "get_state", lambda: gateway)
    monkeypatch.setattr(state_module, "get_state", lambda: gateway)
    return gateway


V1, V2 = small_onnx(seed=1), small_onnx(seed=2)


@pytest.fixture
def ladder(world, state):
    """Tenant A's ``clf``: v1 in production with v2 as its fallback, each on its own agent."""
    model = make_model(world.a, "clf")
    v1 = make_version(model, V1)
    v2 = make_version(model, V2, alias=None)
    model.fallback_version = v2
    model.save()
    world.model, world.v1, world.v2 = model, v1, v2
    world.primary = Agent(state, v1.pk, V1, "primary")
    world.fallback = Agent(state, v2.pk, V2, "fallback")
    return world


def infer(key: str, x: np.ndarray, **body: object) -> tuple[int, dict[str, str], dict]:
    return infers(key, [x], **body)[0]


def infers(key: str, xs: list[np.ndarray], **body: object) -> list[tuple[int, dict, dict]]:
    """Send the requests one after another on one event loop, as a server has."""

    async def scenario() -> list[tuple[int, dict, dict]]:
        replies = []
        for x in xs:
            doc = {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}
                ],
                **body,
            }
            headers = [(b"authorization", f"Bearer {key}".encode())]
            communicator = HttpCommunicator(
                application, "POST", URL, body=json.dumps(doc).encode(), headers=headers
            )
            response = await communicator.get_response(timeout=10)
            got = {k.decode().lower(): v.decode() for k, v in response["headers"]}
            replies.append((response["status"], got, json.loads(response["body"])))
        return replies

    return async_to_sync(scenario)()


def onnx(artifact: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def output(answer: dict) -> np.ndarray:
    tensor = answer["outputs"][0]
    return np.array(tensor["data"], dtype=np.float32).reshape(tensor["shape"])


# The ladder -----------------------------------------------------------------------------------


def test_a_failing_version_is_answered_by_its_fallback_marked_degraded(ladder, state, rng):
    x = rng.normal(size=(2, 4)).astype(np.float32)
    status, headers, answer = infer(ladder.key_a, x)
    assert status == 200 and "degraded" not in headers  # the version answers while it can
    np.testing.assert_allclose(output(answer), onnx(V1, x), rtol=1e-5)

    ladder.primary.mode = "error"
    status, headers, answer = infer(ladder.key_a, x)
    assert status == 200, answer
    assert answer["model_version"] == "2"
    assert answer["parameters"]["degraded"] == "fallback"
    assert headers["x-switchyard-degraded"] == "fallback"
    np.testing.assert_allclose(output(answer), onnx(V2, x), rtol=1e-5)
    # The version failed (guardrails see an error); the client's answer was degraded.
    # Counted per (version, (plan, arm)): no rollout plan routed these.
    counts = {vid: c for (vid, _), c in state.traffic.drain().items()}
    assert (counts[ladder.v1.pk].requests, counts[ladder.v1.pk].errors) == (2, 1)
    assert counts[ladder.v1.pk].degraded == 1
    assert counts[ladder.v2.pk].requests == 1 and counts[ladder.v2.pk].errors == 0


def test_the_breaker_opens_skips_the_version_and_closes_once_it_is_fixed(ladder, state, rng):
    x = rng.normal(size=(1, 4)).astype(np.float32)
    ladder.primary.mode = "error"
    replies = infers(ladder.key_a, [x] * 8)
    assert [status for status, _, _ in replies] == [200] * 8
    assert all(answer["parameters"]["degraded"] == "fallback" for _, _, answer in replies)
    # Three failures opened it: the other five went straight to the fallback.
    assert len(ladder.primary.requests) == 3
    breaker = state.version_breakers[ladder.v1.pk]
    assert breaker.state() == OPEN

    ladder.primary.mode = "ok"  # fixed; the next request after the cooldown is the probe
    time.sleep(0.35)
    assert breaker.state() == HALF_OPEN
    status, headers, answer = infer(ladder.key_a, x)
    assert status == 200 and "parameters" not in answer, answer
    assert len(ladder.primary.requests) == 4 and breaker.state() == CLOSED
    np.testing.assert_allclose(output(answer), onnx(V1, x), rtol=1e-5)


def test_a_failed_probe_opens_the_breaker_for_another_cooldown(ladder, state, rng):
    x = rng.normal(size=(1, 4)).astype(np.float32)
    ladder.primary.mode = "error"
    infers(ladder.key_a, [x] * 3)
    time.sleep(0.35)
    replies = infers(ladder.key_a, [x] * 3)  # one probe, which fails; the rest skip it
    assert [r[2]["parameters"]["degraded"] for r in replies] == ["fallback"] * 3
    assert len(ladder.primary.requests) == 4
    assert state.version_breakers[ladder.v1.pk].state() == OPEN


def test_the_primary_step_has_its_own_timeout(ladder, state, rng):
    Model.objects.filter(pk=ladder.model.pk).update(primary_timeout_ms=100)
    ladder.primary.mode = "silent"
    x = rng.normal(size=(1, 4)).astype(np.float32)
    started = time.monotonic()
    status, _, answer = infer(ladder.key_a, x)
    assert status == 200 and answer["parameters"]["degraded"] == "fallback"
    assert time.monotonic() - started < 1.5  # well within the server's 2 s deadline
    # A step's own timeout is not the version's failure: the breaker is not told.
    assert ladder.v1.pk not in state.version_breakers


def test_the_default_answer_is_the_last_step(world, state, rng):
    model = make_model(world.a, "clf")
    v1 = make_version(model, V1)
    default = [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 0.5]}]
    Model.objects.filter(pk=model.pk).update(default_answer=default)
    primary = Agent(state, v1.pk, V1)
    primary.mode = "error"
    status, headers, answer = infer(world.key_a, rng.normal(size=(1, 4)).astype(np.float32))
    assert status == 200, answer
    assert answer["parameters"]["degraded"] == "default"
    assert answer["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 0.5]}
    ]
    assert headers["x-switchyard-degraded"] == "default"


def test_when_every_step_fails_the_client_gets_the_error(ladder, state, rng):
    ladder.primary.mode = ladder.fallback.mode = "error"
    status, headers, answer = infer(ladder.key_a, rng.normal(size=(1, 4)).astype(np.float32))
    assert status == 500 and "agent error" in answer["error"]
    assert "x-switchyard-degraded" not in headers


def test_a_model_without_a_ladder_fails_as_before(world, state, rng):
    v1 = make_version(make_model(world.a, "clf"), V1)
    Agent(state, v1.pk, V1).mode = "error"
    status, _, answer = infer(world.key_a, rng.normal(size=(1, 4)).astype(np.float32))
    assert status == 500 and "onnxruntime raised" in answer["error"]


def test_a_version_no_agent_has_ready_is_not_ready_not_a_server_error(world, state, rng):
    """A new version's first requests, sent while its agent still loads it: 503 with
    Retry-After, counted as not ready, so they never burn the model's error budget."""
    model = make_model(world.a, "clf")
    make_version(model, V1)  # no agent has it ready
    for _ in range(3):
        status, headers, answer = infer(world.key_a, rng.normal(size=(1, 4)).astype(np.float32))
        assert status == 503 and "no serving agent is ready" in answer["error"]
        assert headers["retry-after"] == "1"
    ((_, counts),) = state.traffic.drain().items()
    assert (counts.not_ready, counts.requests, counts.errors) == (3, 0, 0)
    save_samples({(model.versions.get().pk, NO_PLAN): counts})
    status = model_slos(model)
    assert status["not_ready"] == 3
    assert all(s["requests"] == 0 and s["budget_remaining"] == 1 for s in status["slis"])


def test_client_errors_are_never_degraded(ladder, state, rng):
    # A shape the signature refuses, and a rate limit: the client's, answered as they are.
    status, _, answer = infer(ladder.key_a, rng.normal(size=(1, 3)).astype(np.float32))
    assert status == 400
    assert ladder.fallback.requests == []


def test_a_short_client_deadline_does_not_open_the_breaker(ladder, state, rng):
    ladder.primary.mode = ladder.fallback.mode = "silent"
    x = rng.normal(size=(1, 4)).astype(np.float32)
    replies = infers(ladder.key_a, [x] * 4, parameters={"timeout": 20_000})  # 20 ms
    assert [status for status, _, _ in replies] == [504] * 4
    assert ladder.v1.pk not in state.version_breakers
    assert ladder.primary.link.breaker.state() == CLOSED


@pytest.mark.parametrize(("code", "opens"), [("gone", False), ("internal", True)])
def test_a_forwarded_request_lost_on_the_way_never_opens_the_version_breaker(
    world, state, rng, code, opens
):
    """The version is served only by an agent whose connection another gateway process holds
    (forwarded through the channel layer). That process dying mid-request answers "gone"
    (502): the path failed, not the model; the breaker opens only on the model's own errors."""
    v1 = make_version(make_model(world.a, "clf"), V1)
    pool = state.pool

    async def forward(channel: str, frame: bytes) -> None:
        request = decode_frame(frame)[0]
        pool.deliver_remote(error_frame(request.id, code, "the gateway process went away"))

    pool.remote, pool.remote_sender = {v1.pk: ["elsewhere"]}, forward
    x = rng.normal(size=(1, 4)).astype(np.float32)
    statuses = [status for status, _, _ in infers(world.key_a, [x] * 5)]
    if opens:
        assert statuses == [500] * 3 + [503] * 2  # three failures opened it
        assert state.version_breakers[v1.pk].state() == OPEN
    else:
        assert statuses == [502] * 5
        assert v1.pk not in state.version_breakers


def test_a_forwarded_request_fails_at_once_when_its_agent_leaves_the_listing(world, state, rng):
    """The process holding the agent's connection died mid-request: once the refresh no longer
    lists that agent, the forwarded request answers 502 with a retry hint, not at its deadline
    (2 s here), and the version's breaker counts nothing."""
    v1 = make_version(make_model(world.a, "clf"), V1)
    pool = state.pool

    async def forward(channel: str, frame: bytes) -> None:  # sent, never answered
        asyncio.get_running_loop().call_later(0.1, pool.set_remote, {})

    pool.remote_sender = forward
    pool.set_remote({v1.pk: ["elsewhere"]})
    started = time.monotonic()
    status, headers, _ = infer(world.key_a, rng.normal(size=(1, 4)).astype(np.float32))
    assert status == 502 and headers["retry-after"] == "1"
    assert time.monotonic() - started < 1.0
    assert v1.pk not in state.version_breakers


# Retries and agent links ----------------------------------------------------------------------


def test_a_request_no_agent_started_is_retried_once_on_another_replica(world, state, rng):
    v1 = make_version(make_model(world.a, "clf"), V1)
    first, second = Agent(state, v1.pk, V1, "one"), Agent(state, v1.pk, V1, "two")
    x = rng.normal(size=(1, 4)).astype(np.float32)
    for mode in ("unreachable", "overloaded"):
        first.mode, second.mode = mode, "ok"
        # Whichever link the pool tries first, the request is answered, by the healthy one.
        for _ in range(2):
            status, headers, answer = infer(world.key_a, x)
            assert status == 200 and "parameters" not in answer, answer
    assert state.pool.dispatched["retried"] >= 1
    # Both refusing: one retry, then the refusal itself (503 with Retry-After).
    first.mode = second.mode = "overloaded"
    before = len(first.requests) + len(second.requests)
    status, headers, answer = infer(world.key_a, x)
    assert status == 503 and headers["retry-after"] == "1"
    assert len(first.requests) + len(second.requests) == before + 2


def test_an_unreachable_agent_link_is_skipped_once_its_breaker_opens(world, state, rng):
    v1 = make_version(make_model(world.a, "clf"), V1)
    bad, good = Agent(state, v1.pk, V1, "bad"), Agent(state, v1.pk, V1, "good")
    bad.mode = "unreachable"
    x = rng.normal(size=(1, 4)).astype(np.float32)
    replies = infers(world.key_a, [x] * 12)
    assert [status for status, _, _ in replies] == [200] * 12
    assert bad.link.breaker.state() == OPEN
    assert good.link.breaker.state() == CLOSED
    assert len(good.requests) == 12


def test_a_single_unreachable_agent_answers_503_once_its_breaker_is_open(world, state, rng):
    v1 = make_version(make_model(world.a, "clf"), V1)
    Agent(state, v1.pk, V1).mode = "unreachable"
    x = rng.normal(size=(1, 4)).astype(np.float32)
    replies = infers(world.key_a, [x] * 5)
    assert [status for status, _, _ in replies] == [502, 502, 502, 503, 503]
    assert "failing" in replies[-1][2]["error"] and replies[-1][1]["retry-after"] == "1"


# The settings, their API and the SLI ----------------------------------------------------------


def api(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def test_the_ladder_is_set_through_the_api_audited_and_checked(world):
    model = make_model(world.a, "clf")
    v1 = make_version(model, V1)
    make_version(model, V2, alias=None)
    other = make_version(make_model(world.a, "other"), V1)
    client = api(world.key_a)
    default = [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [0, 1]}]
    body = {
        "fallback_version": 2,
        "primary_timeout_ms": 80,
        "fallback_timeout_ms": 200,
        "default_answer": default,
    }
    # The traffic gate: v2 never served production, and a fallback may answer all of it.
    refused = client.patch("/api/v1/models/clf", body, format="json")
    assert refused.status_code == 403, refused.content
    assert "v2 is not approved for 'production'" in refused.json()["error"]
    assert Model.objects.get(pk=model.pk).fallback_version is None
    assert not AuditEvent.objects.filter(action="model.update").exists()
    # Once production has served v2 (it is v1's last-known-good), v2 may be the fallback.
    set_alias(model, "production", model.versions.get(version=2))
    set_alias(model, "production", v1)
    response = client.patch("/api/v1/models/clf", body, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["fallback_version"] == 2
    assert response.json()["default_answer"] == default
    event = AuditEvent.objects.filter(action="model.update").latest("pk")
    assert event.after["fallback_version"] == 2 and event.before["fallback_version"] is None
    # The fallback is served: agents load it although no alias points at it.
    assert model.versions.get(version=2).pk in set(served_versions().values_list("pk", flat=True))
    assert other.pk in set(served_versions().values_list("pk", flat=True))

    for bad, field in [
        ({"fallback_version": 9}, "fallback_version"),
        ({"fallback_version": "two"}, "fallback_version"),
        ({"primary_timeout_ms": 0}, "primary_timeout_ms"),
        (
            {"default_answer": [{"name": "y", "datatype": "FP32", "shape": [2], "data": [1]}]},
            "data",
        ),
        (
            {"default_answer": [{"name": "y", "datatype": "BYTES", "shape": [1], "data": [1]}]},
            "datatype",
        ),
        ({"default_answer": {"y": 1}}, "default_answer"),
    ]:
        response = client.patch("/api/v1/models/clf", bad, format="json")
        assert response.status_code == 400, (bad, response.content)
        assert field in response.content.decode(), (bad, response.content)
    # Another tenant's model is not found; a version of another model is no fallback.
    assert client.patch("/api/v1/models/nope", body, format="json").status_code == 404
    assert Model.objects.get(pk=model.pk).fallback_version.version == 2


def test_another_tenants_key_cannot_change_the_ladder(world):
    model = make_model(world.a, "clf")
    make_version(model, V1)
    response = api(world.key_b).patch(
        "/api/v1/models/clf", {"primary_timeout_ms": 5}, format="json"
    )
    assert response.status_code in (403, 404)
    assert Model.objects.get(pk=model.pk).primary_timeout_ms is None


def test_degraded_answers_are_their_own_sli_not_availability_failures(world):
    model = make_model(world.a, "clf")
    v1 = make_version(model, V1)
    buckets = [0] * 20
    buckets[0] = 100
    TrafficSample.objects.create(
        version=v1,
        window_end=v1.created_at,
        requests=100,
        errors=7,
        degraded=5,
        latency_buckets=buckets,
    )
    slos = model_slos(model, now=v1.created_at)
    availability = next(s for s in slos["slis"] if s["sli"] == "availability")
    assert availability["bad"] == 2 and availability["value"] == 0.98
    assert slos["degraded"] == 5 and slos["degraded_share"] == 0.05


# The breaker itself -----------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_only():
    breaker = Breaker(threshold=3, cooldown_s=10)
    for _ in range(2):
        breaker.failure(0.0)
    breaker.success()  # a success in between starts the count again
    breaker.failure(0.0)
    breaker.failure(0.0)
    assert breaker.state(1.0) == CLOSED and breaker.available(1.0)
    breaker.failure(1.0)
    assert breaker.state(2.0) == OPEN and not breaker.available(2.0)
    assert breaker.retry_after(2.0) == 9


def test_breaker_half_open_lets_one_probe_out_and_gives_up_on_a_lost_one():
    breaker = Breaker(threshold=1, cooldown_s=5)
    breaker.failure(0.0)
    assert breaker.state(5.0) == HALF_OPEN and breaker.available(5.0)
    breaker.begin(5.0)
    assert not breaker.available(6.0)  # the probe is out
    assert breaker.available(10.0)  # it never reported (its client left): another may go
    breaker.success()
    assert breaker.state(10.0) == CLOSED


@pytest.mark.parametrize("failures", [1, 3])
def test_pool_with_no_ready_link_still_says_so(failures):
    async def scenario() -> None:
        from gateway.dispatch import AgentPool, DispatchError

        pool = AgentPool(breaker_failures=failures)
        with pytest.raises(DispatchError) as raised:
            await pool.infer(1, [], [], None, 1.0)
        assert raised.value.status == 503 and "no serving agent" in raised.value.message

    asyncio.run(scenario())
