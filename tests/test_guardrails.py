"""Guardrail decisions: wait on too little data, roll back on a significant error increase or a
slow p99, advance after the bake time, promote at the last step."""

from datetime import timedelta

import pytest
from django.utils import timezone

from monitoring.models import TrafficSample
from monitoring.traffic import LATENCY_BOUNDS_MS, Counts, percentile_ms
from rollouts.actions import Actor, start_plan
from rollouts.approvals import approve
from rollouts.guardrails import ArmStats, evaluate, judge
from rollouts.models import ApprovalRequest, PlanState, RolloutPolicy
from rollouts.tasks import evaluate_rollouts
from tenants.audit import user_actor
from tenants.models import AuditEvent, Role
from tests.factories import make_member, make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends

RAILS = {"max_error_rate_increase": 0.01, "max_p99_ratio": 2.0, "min_samples": 100}


def stats(requests: int, errors: int = 0, latency_ms: float = 5.0) -> ArmStats:
    counts = Counts()
    for i in range(requests):
        counts.add(latency_ms / 1000, ok=i >= errors)
    return ArmStats(counts.requests, counts.errors, tuple(counts.buckets), counts.fine)


def test_too_few_samples_waits_and_says_so():
    # 4 failures in 40 is bad but not egregious: wait for min_samples (the early abort below).
    verdict = judge(RAILS, stats(500), stats(40, errors=4), baked=True, last_step=False)
    assert verdict.action == "wait" and "candidate 40/100" in verdict.reason


def test_a_significant_error_increase_rolls_back():
    verdict = judge(RAILS, stats(1000, errors=5), stats(1000, errors=80), True, False)
    assert verdict.action == "rollback" and "error rate" in verdict.reason


def test_a_small_noisy_difference_does_not_roll_back():
    # 3 vs 1 errors in 200: within the allowed 1 point and well inside the noise.
    verdict = judge(RAILS, stats(200, errors=1), stats(200, errors=3), True, False)
    assert verdict.action == "advance"


def test_a_slow_candidate_rolls_back_on_p99():
    verdict = judge(RAILS, stats(500, latency_ms=4), stats(500, latency_ms=400), True, False)
    assert verdict.action == "rollback" and "p99" in verdict.reason


def test_healthy_holds_while_baking_then_advances_or_promotes():
    assert judge(RAILS, stats(500), stats(500), baked=False, last_step=False).action == "hold"
    assert judge(RAILS, stats(500), stats(500), baked=True, last_step=False).action == "advance"
    assert judge(RAILS, stats(500), stats(500), baked=True, last_step=True).action == "promote"


def test_percentile_reads_the_histogram():
    counts = Counts()
    for _ in range(98):
        counts.add(0.003, True)
    counts.add(0.3, True)
    counts.add(0.3, True)
    assert percentile_ms(counts.buckets, 0.5) == 5
    assert percentile_ms(counts.buckets, 0.99) == 500
    assert len(counts.buckets) == len(LATENCY_BOUNDS_MS) + 1


@pytest.fixture
def plan(world, onnx_bytes):
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes)
    candidate = make_version(model, small_onnx(seed=2), alias=None)
    RolloutPolicy.objects.create(tenant=world.a, max_weight_without_approval=50)  # steps to 50
    return start_plan(
        model,
        "canary",
        candidate,
        RAILS,
        Actor(None, "test"),
        weight=5,
        steps=[5, 50, 100],
        bake_seconds=60,
    )


def sample(version_id: int, requests: int, errors: int = 0) -> None:
    counts = Counts()
    for i in range(requests):
        counts.add(0.004, ok=i >= errors)
    TrafficSample.objects.create(
        version_id=version_id,
        window_end=timezone.now(),
        requests=requests,
        errors=errors,
        latency_buckets=counts.buckets,
        latency_fine=counts.fine,
    )


def test_beat_task_rolls_back_a_failing_candidate_and_audits_it(plan):
    sample(plan.baseline_id, 1000, errors=2)
    sample(plan.candidate_id, 1000, errors=200)
    assert evaluate_rollouts() == {plan.pk: "rollback"}
    plan.refresh_from_db()
    assert plan.state == PlanState.ROLLED_BACK and plan.weight == 0
    event = AuditEvent.objects.get(action="plan.rollback")
    assert event.actor_label == "guardrails" and "error rate" in event.reason


def test_healthy_candidate_advances_after_bake_then_is_promoted_once_approved(plan):
    later = plan.step_started_at + timedelta(seconds=61)
    sample(plan.baseline_id, 500)
    sample(plan.candidate_id, 500)
    assert evaluate(plan, now=later).action == "advance"
    plan.refresh_from_db()
    assert plan.weight == 50
    # The new step starts with no data: it waits, then judges afresh.
    assert evaluate(plan).action == "wait"
    plan.refresh_from_db()
    assert plan.status_note.startswith("waiting for data")
    plan.weight = 100
    plan.save()
    sample(plan.baseline_id, 500)
    sample(plan.candidate_id, 500)
    # Healthy at the last step: promotion moves production, so the guardrails ask an approver.
    baked = timezone.now() + timedelta(seconds=61)
    verdict = evaluate(plan, now=baked)
    assert verdict.action == "hold" and "waiting for approval" in verdict.reason
    request = ApprovalRequest.objects.get(plan=plan)
    assert request.requested_label == "guardrails" and request.state == "pending"
    assert evaluate(plan, now=baked).action == "hold"  # asks once
    assert ApprovalRequest.objects.filter(plan=plan).count() == 1
    approver = make_member(plan.model.tenant, "ann", Role.APPROVER)
    approve(request, user_actor(approver, Role.APPROVER), "numbers look fine")
    assert evaluate(plan, now=baked).action == "promote"
    plan.refresh_from_db()
    request.refresh_from_db()
    assert plan.state == PlanState.PROMOTED and request.state == "applied"
    assert plan.model.aliases.get(name="production").version_id == plan.candidate_id


def test_at_100_percent_the_baseline_is_judged_on_the_whole_plan(plan):
    # The baseline served during the earlier steps; at 100 % it gets nothing new.
    sample(plan.baseline_id, 500)
    before_step = TrafficSample.objects.get(version_id=plan.baseline_id).window_end
    plan.weight = 100
    plan.step_started_at = before_step + timedelta(microseconds=1)
    plan.save()
    sample(plan.candidate_id, 500)
    TrafficSample.objects.filter(version_id=plan.candidate_id).update(
        window_end=plan.step_started_at + timedelta(seconds=1)
    )
    verdict = evaluate(plan, now=plan.step_started_at + timedelta(seconds=61))
    assert verdict.action == "hold" and "waiting for approval" in verdict.reason


# Online quality from ground-truth feedback ----------------------------------------------------

QUALITY_RAILS = {**RAILS, "max_quality_drop": 0.05}


@pytest.mark.parametrize(
    "base, cand, action",
    [
        (
            {"labelled_rows": 500, "accuracy": 0.90},
            {"labelled_rows": 500, "accuracy": 0.80},
            "rollback",
        ),
        (
            {"labelled_rows": 500, "accuracy": 0.90},
            {"labelled_rows": 500, "accuracy": 0.87},
            "advance",
        ),
        (
            {"labelled_rows": 500, "accuracy": 0.90},
            {"labelled_rows": 40, "accuracy": 0.10},
            "advance",
        ),
        ({"labelled_rows": 500, "mae": 2.0}, {"labelled_rows": 500, "mae": 2.3}, "rollback"),
        ({"labelled_rows": 500, "mae": 2.0}, {"labelled_rows": 500, "mae": 2.05}, "advance"),
    ],
)
def test_online_quality_worse_than_allowed_rolls_back(base, cand, action):
    verdict = judge(QUALITY_RAILS, stats(500), stats(500), True, False, quality=(base, cand))
    assert verdict.action == action
    if action == "rollback":
        assert "online" in verdict.reason


def log_labelled(plan, version_id: int, n: int, correct: int) -> None:
    """``n`` logged one-row predictions of a version, ``correct`` of them labelled right."""
    from monitoring.models import Feedback
    from monitoring.prediction_log import write_records

    now = timezone.now()
    tenant_id = plan.model.tenant_id
    records = []
    for i in range(n):
        rid = f"v{version_id}-{i}"
        records.append(
            {
                "tenant_id": tenant_id,
                "model_id": plan.model.pk,
                "version_id": version_id,
                "request_id": rid,
                "inputs": {},
                "scores": [0.9],
                "latency_ms": 3.0,
                "status": 200,
                "created_at": now,
            }
        )
        Feedback.objects.create(
            tenant_id=tenant_id, request_id=rid, label=1 if i < correct else 0, received_at=now
        )
    write_records(records)


def test_the_guardrails_roll_back_a_candidate_whose_online_accuracy_falls(plan):
    plan.guardrails = QUALITY_RAILS
    plan.save(update_fields=["guardrails"])
    sample(plan.baseline_id, 500)
    sample(plan.candidate_id, 500)
    log_labelled(plan, plan.baseline_id, 120, correct=110)  # 0.92
    log_labelled(plan, plan.candidate_id, 120, correct=90)  # 0.75
    verdict = evaluate(plan)
    assert verdict.action == "rollback" and "online accuracy 0.750" in verdict.reason
    plan.refresh_from_db()
    assert plan.state == PlanState.ROLLED_BACK
