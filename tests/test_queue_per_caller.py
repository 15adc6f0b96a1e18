"""``max_queue_per_caller`` end to end: set through the registry API (checked against
``max_queue``, audited), carried on the agent's assign frame, and enforced by the batcher built
from that frame the way the agent builds it (serving_agent._versions)."""

from __future__ import annotations

import asyncio

import pytest
from rest_framework.test import APIClient

from fleet.assignments import version_spec
from registry.models import ModelVersion
from serving_agent import Batcher, OverShare
from serving_agent.protocol import Assign
from tenants.models import AuditEvent
from tests.agent.test_scheduling import Gated, queued, release, settle, submit, x
from tests.factories import make_model, make_version

pytestmark = pytest.mark.backends


def client_with_key(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def test_per_caller_cap_is_checked_against_max_queue_and_isolated(world, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    api = client_with_key(world.key_a)
    url = "/api/v1/models/clf/versions/1"
    too_big = api.patch(url, {"max_queue": 8, "max_queue_per_caller": 9}, format="json")
    assert too_big.status_code == 400
    assert "max_queue_per_caller" in str(too_big.json()) and "at most" in str(too_big.json())
    assert api.patch(url, {"max_queue_per_caller": -1}, format="json").status_code == 400
    other = client_with_key(world.key_b).patch(url, {"max_queue_per_caller": 1}, format="json")
    assert other.status_code == 404
    assert ModelVersion.objects.get().max_queue_per_caller == 0


def test_a_cap_set_through_the_api_reaches_the_batcher_and_caps_a_flood(world, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    api = client_with_key(world.key_a)
    response = api.patch(
        "/api/v1/models/clf/versions/1",
        {"max_queue": 16, "max_queue_per_caller": 3},
        format="json",
    )
    assert response.status_code == 200 and response.json()["max_queue_per_caller"] == 3
    event = AuditEvent.objects.filter(action="version.settings").latest("pk")
    assert event.after["max_queue_per_caller"] == 3

    # The assign frame as the gateway sends it and the agent decodes it.
    frame = Assign(versions=[version_spec(ModelVersion.objects.get())]).model_dump_json()
    spec = Assign.model_validate_json(frame).versions[0]
    assert spec.max_queue_per_caller == 3

    async def flood() -> list[object]:
        model = Gated()
        batcher = Batcher(
            model.runtime(),
            max_batch_size=1,
            max_queue=spec.max_queue,
            max_queue_per_caller=spec.max_queue_per_caller,
        )
        first = asyncio.create_task(batcher.infer_timed(x(-1), caller=99))
        while not model.started.is_set():
            await asyncio.sleep(0.001)
        mine = [submit(batcher, i, caller=1) for i in range(6)]
        await queued(*mine)
        results = await settle(first, *mine, release(model))
        await batcher.stop()
        return results[1:7]

    results = asyncio.run(flood())
    # Another caller shares the version: the flooding caller holds at most 3.
    assert [isinstance(r, OverShare) for r in results] == [False] * 3 + [True] * 3
