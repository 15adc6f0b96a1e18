"""Rollout plans over the API: guardrails required, weights and kill switch audited, roles and
tenant isolation enforced."""

import pytest
from rest_framework.test import APIClient

from rollouts.models import RolloutPlan
from rollouts.routing import active_split
from tenants.models import AuditEvent
from tests.factories import make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}


def key_client(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


@pytest.fixture
def two_versions(world, onnx_bytes):
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes)
    make_version(model, small_onnx(seed=3), alias=None)
    return model


def start(client, **overrides):
    body = {"mode": "canary", "candidate": 2, "weight": 5, "guardrails": GUARDRAILS, **overrides}
    return client.post("/api/v1/models/clf/rollouts", body, format="json")


def test_canary_plan_starts_from_the_alias_and_routes_a_share(world, two_versions):
    response = start(key_client(world.key_a))
    assert response.status_code == 201, response.json()
    plan = response.json()
    assert (plan["baseline"], plan["candidate"], plan["weight"]) == (1, 2, 5)
    split = active_split(world.a.pk, "clf", "production")
    assert [(a.name, a.weight) for a in split.arms] == [("baseline", 95), ("candidate", 5)]
    assert AuditEvent.objects.get(action="plan.start").tenant == world.a


def test_a_plan_without_guardrails_cannot_start(world, two_versions):
    response = start(key_client(world.key_a), guardrails={})
    assert response.status_code == 400 and "guardrails" in response.json()["error"]
    assert not RolloutPlan.objects.exists()


def test_only_one_active_plan_per_alias(world, two_versions):
    client = key_client(world.key_a)
    assert start(client).status_code == 201
    second = start(client)
    assert second.status_code == 400 and "active rollout plan" in second.json()["error"]


def test_weight_change_and_kill_switch_are_audited(world, two_versions):
    client = key_client(world.key_a)
    plan_id = start(client).json()["id"]
    moved = client.post(
        f"/api/v1/rollouts/{plan_id}/weight", {"weight": 10, "reason": "bake ok"}, format="json"
    )
    assert moved.status_code == 200 and moved.json()["weight"] == 10
    killed = client.post(f"/api/v1/rollouts/{plan_id}/kill", {"reason": "errors"}, format="json")
    assert killed.json()["state"] == "rolled_back"
    assert active_split(world.a.pk, "clf", "production") is None
    events = [e for e in client.get("/api/v1/audit").json() if e["action"].startswith("plan.")]
    assert [e["action"] for e in events] == ["plan.kill", "plan.weight", "plan.start"]
    assert events[1]["before"]["weight"] == 5 and events[1]["after"]["weight"] == 10
    assert events[0]["reason"] == "errors"
    again = client.post(f"/api/v1/rollouts/{plan_id}/kill", {}, format="json")
    assert again.status_code == 409 and "already rolled_back" in again.json()["error"]


def test_audit_events_are_append_only(world, two_versions):
    start(key_client(world.key_a))
    event = AuditEvent.objects.get(action="plan.start")
    event.reason = "rewritten"
    with pytest.raises(Exception, match="append-only"):
        event.save()
    with pytest.raises(Exception, match="append-only"):
        event.delete()


def test_bad_weight_and_unknown_candidate_are_400_and_404(world, two_versions):
    client = key_client(world.key_a)
    assert start(client, candidate=9).status_code == 404
    plan_id = start(client).json()["id"]
    bad = client.post(f"/api/v1/rollouts/{plan_id}/weight", {"weight": 150}, format="json")
    assert bad.status_code == 400 and "weight" in bad.json()["error"]


def test_viewer_cannot_change_weights(world, two_versions):
    plan_id = start(key_client(world.key_a)).json()["id"]
    viewer = APIClient()
    viewer.force_login(world.viewer_a)
    assert viewer.get(f"/api/v1/rollouts/{plan_id}").status_code == 200
    response = viewer.post(f"/api/v1/rollouts/{plan_id}/weight", {"weight": 50}, format="json")
    assert response.status_code == 403


def test_other_tenant_gets_404_on_every_rollout_endpoint(world, two_versions):
    plan_id = start(key_client(world.key_a)).json()["id"]
    other = key_client(world.key_b)
    assert start(other).status_code == 404
    assert other.get("/api/v1/models/clf/rollouts").status_code == 404
    assert other.get(f"/api/v1/rollouts/{plan_id}").status_code == 404
    assert (
        other.post(f"/api/v1/rollouts/{plan_id}/weight", {"weight": 1}, format="json").status_code
        == 404
    )
    assert other.post(f"/api/v1/rollouts/{plan_id}/kill", {}, format="json").status_code == 404
    for action in ("pause", "resume", "promotion"):
        url = f"/api/v1/rollouts/{plan_id}/{action}"
        assert other.post(url, {}, format="json").status_code == 404, action
    assert other.get(f"/api/v1/rollouts/{plan_id}/metrics").status_code == 404
    promotion = {"version": 2}
    assert other.post("/api/v1/models/clf/promotions", promotion, format="json").status_code == 404
    assert {e["action"] for e in other.get("/api/v1/audit").json()} == {"key.create"}
