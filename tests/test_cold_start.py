"""Cold starts at the gateway: a request for a deployed version with no ready replica wakes its
deployment and is held until a replica is ready (served), or until the hold time (503 with
Retry-After); a streaming client hears "loading" meanwhile. Against fake agent links in the
pool; the real processes are in tests/e2e/test_autoscale_e2e.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator

from fleet.models import Deployment, Pool
from gateway.metrics import COLD_START_WAIT
from gateway.oip import oip_app
from gateway.state import GatewayState
from tests.factories import make_model, make_version
from tests.onnx_models import small_onnx
from tests.test_generation import FakeAgent, frames_until_end, make_textgen, socket

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1] * 4}]}


def deploy(world, version) -> Deployment:
    pool, _ = Pool.objects.get_or_create(name="local", defaults={"backend": "local"})
    return Deployment.objects.create(tenant=world.a, version=version, pool=pool)


@pytest.fixture
def state(monkeypatch, settings) -> GatewayState:
    """One gateway state for the test, with a short hold; the autoscale run a wake queues is
    not consumed here (no worker): the test plays the replica that comes up."""
    from gateway import generate_ws, oip

    gateway_state = GatewayState()
    gateway_state.cold_start_hold_s = 1.5
    monkeypatch.setattr(generate_ws, "get_state", lambda: gateway_state)
    monkeypatch.setattr(oip, "get_state", lambda: gateway_state)
    return gateway_state


def held(tenant: str, model: str, outcome: str) -> float:
    """Holds counted in switchyard_cold_start_wait_seconds for version 1 of the model."""
    child = COLD_START_WAIT.labels(tenant, model, "1", outcome)
    return sum(b.get() for b in child._buckets)


def test_a_held_stream_hears_loading_then_gets_its_tokens(world, state):
    version = make_textgen(make_model(world.a, "writer", task="generator"))
    deployment = deploy(world, version)
    state.cold_start_hold_s = 10
    before = held(world.a.slug, "writer", "ready")

    async def scenario():
        async with socket(world.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "hi"})
            loading = await ws.receive_json_from(timeout=5)
            FakeAgent(state, version.pk)  # the replica reports the version ready
            return loading, await frames_until_end(ws, "g")

    loading, frames = async_to_sync(scenario)()
    assert loading["type"] == "loading" and loading["id"] == "g"
    assert loading["stage"] == "scaling up" and 0 < loading["progress"] < 1
    assert "".join(f["text"] for f in frames if f["type"] == "token") == "HI"
    deployment.refresh_from_db()
    assert deployment.woken_at is not None
    assert held(world.a.slug, "writer", "ready") == before + 1


def infer(key: str) -> tuple[int, dict, dict, float]:
    """POST an OIP v2 inference to the lean ASGI app; (status, headers, body, seconds)."""

    async def scenario():
        communicator = HttpCommunicator(
            oip_app,
            "POST",
            "/v2/models/clf/infer",
            body=json.dumps(BODY).encode(),
            headers=[(b"authorization", f"Bearer {key}".encode())],
        )
        started = time.monotonic()
        response = await communicator.get_response(timeout=10)
        return response, time.monotonic() - started

    response, waited = async_to_sync(scenario)()
    headers = {k.decode().lower(): v.decode() for k, v in response["headers"]}
    return response["status"], headers, json.loads(response["body"]), waited


def test_a_cold_start_past_the_hold_is_told_to_retry(world, state):
    deploy(world, make_version(make_model(world.a, "clf"), small_onnx()))
    before = held(world.a.slug, "clf", "timed_out")
    status, headers, body, waited = infer(world.key_a)
    assert status == 503 and headers["retry-after"] == "5"
    assert "cold start" in body["error"]
    assert 1.5 <= waited < 5
    assert held(world.a.slug, "clf", "timed_out") == before + 1


def test_a_version_without_a_deployment_is_not_held(world, state):
    make_version(make_model(world.a, "clf"), small_onnx())
    before = held(world.a.slug, "clf", "timed_out")
    status, _, body, waited = infer(world.key_a)
    assert status == 503 and "no serving agent" in body["error"]
    assert waited < 1.0
    assert not Deployment.objects.exists()
    assert held(world.a.slug, "clf", "timed_out") == before  # no cold start: nothing held


def test_waking_is_not_repeated_for_every_held_request(world, state, monkeypatch):
    version = make_version(make_model(world.a, "clf"), small_onnx())
    deploy(world, version)
    calls = []
    from fleet import coldstart

    real_wake = coldstart.wake
    monkeypatch.setattr(coldstart, "wake", lambda vid: calls.append(vid) or real_wake(vid))

    async def scenario():
        await asyncio.gather(*(state.ready(version.pk) for _ in range(5)), return_exceptions=True)

    async_to_sync(scenario)()
    # Five requests held 1.5 s each: one wake, then none within WAKE_EVERY_S.
    assert calls == [version.pk]
