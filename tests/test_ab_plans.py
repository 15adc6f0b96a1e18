"""A/B plans end to end in one process: the real ASGI application routes each user to a sticky
arm, the gateway counts traffic per (version, plan, arm) (two arms may share a version), the
guardrails drop an arm that breaches them and declare a winner; and shadow copies stay out of
the version's traffic counts."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from gateway.routes import resolve_version_id
from gateway.state import GatewayState
from monitoring.models import TrafficSample
from monitoring.traffic import Counts, save_samples, timeseries
from platform_site.asgi import application
from rollouts.actions import Actor, start_plan
from rollouts.approvals import approve
from rollouts.arms import plan_arm_metrics
from rollouts.guardrails import evaluate
from rollouts.models import ApprovalRequest, PlanArm, PlanState, RequestKind, RolloutPolicy
from rollouts.routing import active_split
from rollouts.tasks import evaluate_rollouts
from tenants.audit import user_actor
from tenants.models import AuditEvent, Role
from tests import test_fallback_ladder as ladder
from tests.factories import make_member, make_model, make_version
from tests.onnx_models import small_onnx
from tests.test_fallback_ladder import V1, V2, Agent
from tests.test_guardrails import log_labelled

pytestmark = pytest.mark.django_db

# The in-process gateway with agent links (tests/test_fallback_ladder.py), as a fixture here.
gateway_state = ladder.state

RAILS = {"max_error_rate_increase": 0.01, "max_p99_ratio": 2.0, "min_samples": 100}
URL = "/v2/models/clf/infer"
X = np.full((1, 4), 0.25, dtype=np.float32)


def infer_as(key: str, users: list[str]) -> list[tuple[int, dict]]:
    """One request per user id (the plan's routing header), in order, on one event loop."""

    async def scenario() -> list[tuple[int, dict]]:
        replies = []
        for user in users:
            doc = {
                "inputs": [
                    {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": X.ravel().tolist()}
                ]
            }
            headers = [
                (b"authorization", f"Bearer {key}".encode()),
                (b"x-user-id", user.encode()),
            ]
            communicator = HttpCommunicator(
                application, "POST", URL, body=json.dumps(doc).encode(), headers=headers
            )
            response = await communicator.get_response(timeout=10)
            replies.append((response["status"], json.loads(response["body"])))
        await asyncio.sleep(0.3)  # shadow copies run after their replies: let them finish
        return replies

    return async_to_sync(scenario)()


@pytest.fixture
def model(world):
    model = make_model(world.a, "clf")
    model.log_sample_rate = 0.0  # no prediction log writer outliving the test's database
    model.save(update_fields=["log_sample_rate"])
    world.v1 = make_version(model, V1)
    world.v2 = make_version(model, V2, alias=None)
    # An experiment's arms share traffic evenly: a policy that allows it without approval.
    RolloutPolicy.objects.create(tenant=world.a, max_weight_without_approval=50)
    return model


def ab_plan(model, arms, **rails):
    v2 = model.versions.get(version=2)
    return start_plan(
        model, "ab", v2, RAILS | rails, Actor(None, "test"), arms=arms, bake_seconds=60
    )


def flush(state: GatewayState) -> None:
    """What the gateway's refresh loop does every 5 s."""
    save_samples(state.traffic.drain())


def test_an_ab_plan_routes_sticky_and_measures_each_arm(world, model, gateway_state):
    state = gateway_state
    Agent(state, world.v1.pk, V1, "one")
    Agent(state, world.v2.pk, V2, "two")
    plan = ab_plan(model, [("a", world.v1, 50), ("b", world.v2, 50)])
    users = [f"user-{i}" for i in range(40)]
    first = infer_as(world.key_a, users)
    again = infer_as(world.key_a, users)
    refused = [(status, body) for status, body in first + again if status != 200]
    assert not refused, refused[:3]
    served = [body["model_version"] for _, body in first]
    assert served == [body["model_version"] for _, body in again]  # sticky per user
    split = active_split(world.a.pk, "clf", "production")
    expected = ["1" if split.choose(u).name == "a" else "2" for u in users]
    assert served == expected and {"1", "2"} <= set(served)
    flush(state)
    rows = TrafficSample.objects.filter(plan_id=plan.pk)
    per_arm = {arm: sum(r.requests for r in rows.filter(arm=arm)) for arm in ("a", "b")}
    assert per_arm == {"a": 2 * served.count("1"), "b": 2 * served.count("2")}
    metrics = {m["arm"]: m for m in plan_arm_metrics(plan)}
    assert metrics["a"]["requests"] == per_arm["a"] and metrics["b"]["requests"] == per_arm["b"]


def test_two_arms_on_one_version_are_measured_apart(world, model, gateway_state):
    state = gateway_state
    Agent(state, world.v1.pk, V1, "one")
    plan = ab_plan(model, [("control", world.v1, 50), ("same", world.v1, 50)])
    infer_as(world.key_a, [f"u{i}" for i in range(30)])
    flush(state)
    metrics = {m["arm"]: m for m in plan_arm_metrics(plan)}
    assert metrics["control"]["version"] == metrics["same"]["version"] == 1
    assert metrics["control"]["requests"] + metrics["same"]["requests"] == 30
    assert metrics["control"]["requests"] > 0 and metrics["same"]["requests"] > 0
    # The rollout page's charts draw each arm's own line.
    arms = {"control": world.v1.pk, "same": world.v1.pk}
    series = timeseries(arms, plan_id=plan.pk)
    for name in arms:
        charted = sum(point["rps"] * 10 for point in series[name])  # 10 s steps
        assert charted == pytest.approx(metrics[name]["requests"])


def arm_sample(plan, arm: str, version_id: int, requests: int, errors: int) -> None:
    counts = Counts()
    for i in range(requests):
        counts.add(0.004, ok=i >= errors)
    TrafficSample.objects.create(
        version_id=version_id,
        plan_id=plan.pk,
        arm=arm,
        window_end=timezone.now(),
        requests=requests,
        errors=errors,
        latency_buckets=counts.buckets,
        latency_fine=counts.fine,
    )


def test_a_significantly_better_arm_is_declared_the_winner_once(world, model):
    plan = ab_plan(model, [("a", world.v1, 50), ("b", world.v2, 50)])
    arm_sample(plan, "a", world.v1.pk, 50, 1)
    arm_sample(plan, "b", world.v2.pk, 50, 0)
    verdict = evaluate(plan)
    assert verdict.action == "wait" and "a 50/100" in verdict.reason
    arm_sample(plan, "a", world.v1.pk, 2000, 120)  # 6 % failures
    arm_sample(plan, "b", world.v2.pk, 2000, 40)  # 2 %
    # The same version's requests outside the plan do not count for its arm.
    TrafficSample.objects.create(
        version_id=world.v2.pk, window_end=timezone.now(), requests=5000, errors=4000,
        latency_buckets=[0] * 15,
    )  # fmt: skip
    assert evaluate_rollouts() == {plan.pk: "decide"}
    plan.refresh_from_db()
    assert plan.ab_result["winner"] == "b" and plan.ab_result["metric"] == "error rate"
    assert plan.status_note.startswith("winner: arm b, error rate 1.95 % vs a 5.90 %")
    event = AuditEvent.objects.get(action="plan.ab_winner")
    assert event.actor_label == "guardrails" and event.after["ab_result"]["winner"] == "b"
    # Decided once; the candidate's arm won, so the guardrails would ask for its promotion, but
    # the errors spent the error budget: releases are frozen, and the note says so.
    assert evaluate(plan).action == "hold" and evaluate(plan).action == "hold"
    assert AuditEvent.objects.filter(action="plan.ab_winner").count() == 1
    plan.refresh_from_db()
    assert plan.state == PlanState.RUNNING  # promotion stays an approver's decision
    assert "error budget" in plan.status_note, plan.status_note
    # Shown in the API (to its tenant only) and on the rollout page.
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.key_a}")
    assert api.get(f"/api/v1/rollouts/{plan.pk}").json()["ab_result"]["winner"] == "b"
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.key_b}")
    assert api.get(f"/api/v1/rollouts/{plan.pk}").status_code == 404
    web = Client()
    web.force_login(world.viewer_a)
    assert "winner: arm b on error rate" in web.get(f"/rollouts/{plan.pk}/").content.decode()


def test_with_ground_truth_the_winner_is_judged_on_online_accuracy(world, model):
    plan = ab_plan(model, [("a", world.v1, 50), ("b", world.v2, 50)])
    arm_sample(plan, "a", world.v1.pk, 300, 0)
    arm_sample(plan, "b", world.v2.pk, 300, 0)  # no difference in errors
    assert evaluate(plan).action == "hold"  # measuring error rate: nothing significant
    log_labelled(plan, world.v1.pk, 150, correct=90)  # 60 %
    log_labelled(plan, world.v2.pk, 150, correct=140)  # 93 %
    assert evaluate(plan).action == "decide"
    plan.refresh_from_db()
    assert plan.ab_result["winner"] == "b" and plan.ab_result["metric"] == "online accuracy"
    assert "online accuracy 93.33 % vs a 60.00 %" in plan.ab_result["reason"]


def test_equal_arms_at_the_sample_cap_are_declared_no_difference(world, model):
    plan = ab_plan(model, [("a", world.v1, 50), ("b", world.v2, 50)], ab_max_samples=1000)
    arm_sample(plan, "a", world.v1.pk, 1000, 20)
    arm_sample(plan, "b", world.v2.pk, 1000, 21)
    assert evaluate(plan).action == "decide"
    plan.refresh_from_db()
    assert plan.ab_result["winner"] is None and "no difference" in plan.ab_result["reason"]


def test_an_arm_that_breaches_the_guardrails_is_dropped_and_audited(world, model):
    plan = ab_plan(model, [("a", world.v1, 50), ("b", world.v2, 50)])
    arm_sample(plan, "a", world.v1.pk, 500, 2)
    arm_sample(plan, "b", world.v2.pk, 30, 30)  # failing every request: the early abort
    verdict = evaluate(plan)
    assert verdict.action == "drop" and verdict.reason.startswith("arm b vs a: early abort")
    assert PlanArm.objects.get(plan=plan, name="b").weight == 0
    event = AuditEvent.objects.get(action="plan.arm_drop")
    assert event.before["arms"] == {"a": 50, "b": 50} and event.after["arms"]["b"] == 0
    split = active_split(world.a.pk, "clf", "production")
    assert [a.name for a in split.arms] == ["a"]  # the gateways route every user to a
    assert evaluate(plan).action == "hold"  # one arm left: nothing to compare


def test_a_dropped_arms_share_goes_to_the_baseline_so_no_other_arm_grows(world, model):
    """Weights are relative: dropping c (15) alone would turn b's 15 into 15/85 = 17.6 %."""
    v3 = make_version(model, small_onnx(seed=5), alias=None)
    plan = ab_plan(model, [("a", world.v1, 70), ("b", world.v2, 15), ("c", v3, 15)])
    arm_sample(plan, "a", world.v1.pk, 500, 2)
    arm_sample(plan, "c", v3.pk, 30, 30)
    assert evaluate(plan).action == "drop"
    assert {a.name: a.weight for a in plan.arms.all()} == {"a": 85, "b": 15, "c": 0}


def test_a_drop_the_gate_refuses_ends_the_plan(world, model):
    """No arm serves the baseline (v2; a serves v1, approved as production's previous version),
    and after the policy tightened, dropping c would raise b past the limit: rolled back."""
    other = make_model(world.a, "other")
    o1 = make_version(other, V1)
    make_version(other, V2)  # production moves to v2: v1 is its last-known-good
    o3 = make_version(other, small_onnx(seed=5), alias=None)
    o4 = make_version(other, small_onnx(seed=6), alias=None)
    arms = [("a", o1, 50), ("b", o3, 25), ("c", o4, 25)]
    plan = start_plan(other, "ab", o3, RAILS, Actor(None, "test"), arms=arms)
    RolloutPolicy.objects.filter(tenant=world.a).update(max_weight_without_approval=30)
    arm_sample(plan, "a", o1.pk, 500, 2)
    arm_sample(plan, "c", o4.pk, 30, 30)
    verdict = evaluate(plan)
    assert verdict.action == "rollback" and "rolled back" in verdict.reason, verdict
    plan.refresh_from_db()
    assert plan.state == PlanState.ROLLED_BACK


# Shadow copies ----------------------------------------------------------------------------------


def test_a_shadow_copy_leaves_the_versions_traffic_samples_untouched(world, model, gateway_state):
    state = gateway_state
    Agent(state, world.v1.pk, V1, "one")
    Agent(state, world.v2.pk, V2, "two")
    plan = start_plan(model, "shadow", world.v2, RAILS, Actor(None, "test"), shadow_sample=1.0)
    # The shadow version's route is cached, as on a warm gateway: the copies run after their
    # replies, outside the request, where this test process has no database connection.
    state._by_id[(world.a.pk, world.v2.pk)] = resolve_version_id(world.a.pk, world.v2.pk)
    replies = infer_as(world.key_a, [f"u{i}" for i in range(10)])
    assert all(status == 200 and body["model_version"] == "1" for status, body in replies)
    assert state.shadow_stats[plan.pk] == [10, 10, 0]  # ten copies answered (and agreed)
    flush(state)
    assert not TrafficSample.objects.filter(version_id=world.v2.pk).exists()
    baseline = TrafficSample.objects.get(version_id=world.v1.pk)
    assert baseline.requests == 10 and baseline.plan_id == plan.pk and baseline.arm == "baseline"


def decided_on_accuracy(world, model, correct_a: int, correct_b: int):
    """An A/B plan (a: v1, b: v2, the candidate) whose winner the guardrails have declared on
    online accuracy: no errors on either arm, ``correct_*`` of 150 labelled answers right."""
    plan = ab_plan(model, [("a", world.v1, 50), ("b", world.v2, 50)])
    arm_sample(plan, "a", world.v1.pk, 300, 0)
    arm_sample(plan, "b", world.v2.pk, 300, 0)
    log_labelled(plan, world.v1.pk, 150, correct=correct_a)
    log_labelled(plan, world.v2.pk, 150, correct=correct_b)
    assert evaluate(plan).action == "decide"
    plan.refresh_from_db()
    return plan


def test_an_approved_promotion_of_the_winning_candidate_lands(world, model):
    """An A/B plan's winner, once approved, is carried out by the guardrails as a canary's
    promotion is: production points at the candidate and the plan ends promoted."""
    plan = decided_on_accuracy(world, model, correct_a=90, correct_b=140)
    assert evaluate(plan).action == "hold"  # asks for the promotion, once
    assert evaluate(plan).action == "hold"
    asked = ApprovalRequest.objects.get(plan=plan, kind=RequestKind.PROMOTION)
    assert (asked.state, asked.requested_label) == ("pending", "guardrails")
    plan.refresh_from_db()
    assert plan.status_note == f"arm b won: waiting for approval (request #{asked.pk})"
    approver = make_member(world.a, "appr-a", "approver")
    approve(asked, user_actor(approver, Role.APPROVER), "b wins")
    plan.refresh_from_db()
    assert evaluate(plan).action == "promote"
    plan.refresh_from_db()
    assert plan.state == PlanState.PROMOTED
    assert model.aliases.get(name="production").version_id == world.v2.pk
    asked.refresh_from_db()
    assert asked.state == "applied"
    assert AuditEvent.objects.filter(action="plan.promote", actor_label="guardrails").exists()


def test_when_the_baseline_wins_nothing_is_asked(world, model):
    plan = decided_on_accuracy(world, model, correct_a=140, correct_b=90)
    assert evaluate(plan).action == "hold"
    assert not ApprovalRequest.objects.filter(plan=plan, kind=RequestKind.PROMOTION).exists()
