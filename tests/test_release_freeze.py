"""The release freeze: while a model's error budget is spent (``monitoring.slo``), starting a
plan, advancing a step and promoting are refused, naming the SLO; an approver's override (a
reason and an expiry, audited) lifts it; rollbacks and kills are never frozen."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from monitoring.models import TrafficSample
from monitoring.slo import error_budget_spent
from monitoring.traffic import Counts
from rollouts import actions, approvals
from rollouts.guardrails import evaluate
from rollouts.models import PlanState, RolloutPlan
from tenants.audit import user_actor
from tenants.models import AuditEvent, Role
from tests.factories import as_user, make_member, make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}


@pytest.fixture
def team(world, onnx_bytes):
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes)
    make_version(model, small_onnx(seed=3), alias=None)
    world.ann = make_member(world.a, "ann", Role.APPROVER)
    world.model = model
    return world


def burn(version_id: int, requests: int = 500, errors: int = 50) -> None:
    """Traffic with ``errors`` server errors: 10 % against a 99.9 % objective spends the
    30-day budget many times over."""
    counts = Counts()
    for i in range(requests):
        counts.add(0.004, ok=i >= errors)
    TrafficSample.objects.create(
        version_id=version_id,
        window_end=timezone.now(),
        requests=requests,
        errors=errors,
        latency_buckets=counts.buckets,
    )


def start_canary(team, **extra) -> RolloutPlan:
    return actions.start_plan(
        team.model,
        "canary",
        team.model.versions.get(version=2),
        GUARDRAILS,
        user_actor(team.engineer_a, Role.ENGINEER),
        weight=5,
        steps=[5, 10, 100],
        bake_seconds=60,
        **extra,
    )


def test_the_budget_is_spent_only_past_the_objective(team):
    v1 = team.model.versions.get(version=1)
    burn(v1.pk, requests=10_000, errors=5)  # 0.05 % against 0.1 % allowed: budget left
    assert error_budget_spent(team.model) == []
    burn(v1.pk, requests=1_000, errors=50)
    (spent,) = error_budget_spent(team.model)
    assert spent.startswith("the availability SLO (99.9 % of requests without a server error)")
    assert "error budget spent" in spent


def test_a_spent_budget_freezes_starts_steps_and_promotions_until_an_override(team):
    plan = start_canary(team)
    burn(plan.baseline_id)
    burn(plan.candidate_id)  # the same error rate: the guardrails see no regression
    verdict = evaluate(plan, now=timezone.now() + timedelta(seconds=61))
    plan.refresh_from_db()
    assert verdict.action == "hold" and plan.weight == 5
    assert plan.status_note.startswith("release freeze: the availability SLO")
    engineer = as_user(team.engineer_a)
    raised = engineer.post(f"/api/v1/rollouts/{plan.pk}/weight", {"weight": 10})
    assert raised.status_code == 409 and "release freeze" in raised.json()["error"]
    assert engineer.post(f"/api/v1/rollouts/{plan.pk}/weight", {"weight": 1}).status_code == 200
    promotion = engineer.post(f"/api/v1/rollouts/{plan.pk}/promotion")
    assert promotion.status_code == 409
    assert "availability SLO" in promotion.json()["error"]
    # Kills are never frozen.
    assert engineer.post(f"/api/v1/rollouts/{plan.pk}/kill", {"reason": "x"}).status_code == 200
    body = {"mode": "canary", "candidate": 2, "weight": 5, "guardrails": GUARDRAILS}
    refused = engineer.post("/api/v1/models/clf/rollouts", body)
    assert refused.status_code == 409 and "error budget spent" in refused.json()["error"]
    assert RolloutPlan.objects.filter(state=PlanState.RUNNING).count() == 0
    status = engineer.get("/api/v1/models/clf/freeze-override").json()
    assert status["frozen"] is True and status["override"] is None

    # The override: an approver's, with a reason and an expiry, audited.
    override = {"reason": "the errors come from a client bug, fixed", "hours": 2}
    assert engineer.post("/api/v1/models/clf/freeze-override", override).status_code == 403
    no_reason = as_user(team.ann).post("/api/v1/models/clf/freeze-override", {"reason": " "})
    assert no_reason.status_code == 400 and "reason" in no_reason.json()["error"]
    too_long = as_user(team.ann).post(
        "/api/v1/models/clf/freeze-override", {**override, "hours": 1000}
    )
    assert too_long.status_code == 400 and "hours" in too_long.json()["error"]
    lifted = as_user(team.ann).post("/api/v1/models/clf/freeze-override", override)
    assert lifted.status_code == 201, lifted.json()
    assert lifted.json()["frozen"] is False and lifted.json()["override"]["by"] == "ann"
    event = AuditEvent.objects.get(action="freeze.override")
    assert event.actor_label == "ann" and event.reason == override["reason"]
    assert event.after["budget_spent"] and "expires_at" in event.after
    started = engineer.post("/api/v1/models/clf/rollouts", body)
    assert started.status_code == 201, started.json()


def test_rollbacks_are_never_frozen(team):
    plan = start_canary(team)
    burn(plan.baseline_id, errors=0)
    burn(plan.candidate_id, errors=200)  # the candidate spends the budget and breaches
    assert error_budget_spent(team.model)
    verdict = evaluate(plan, now=timezone.now() + timedelta(seconds=61))
    plan.refresh_from_db()
    assert verdict.action == "rollback" and plan.state == PlanState.ROLLED_BACK


def test_an_approved_promotion_waits_out_the_freeze(team):
    plan = start_canary(team)
    request = approvals.request_promotion(
        team.model, None, user_actor(team.engineer_a, Role.ENGINEER), plan=plan
    )
    approvals.approve(request, user_actor(team.ann, Role.APPROVER))
    burn(plan.baseline_id)
    promoted, note = approvals.promote_when_approved(plan, "healthy at the last step")
    plan.refresh_from_db()
    assert promoted is False and note.startswith("release freeze")
    assert plan.status_note == note and plan.state == PlanState.RUNNING
    assert team.model.aliases.get(name="production").version.version == 1
    as_user(team.ann).post(
        "/api/v1/models/clf/freeze-override", {"reason": "known incident", "hours": 1}
    )
    assert approvals.promote_when_approved(plan, "healthy at the last step")[0] is True
    assert team.model.aliases.get(name="production").version.version == 2


def test_the_model_page_shows_the_freeze_where_it_blocks_and_the_approvers_override(team):
    """The measured gap: the model page did not show the freeze, and the override was API-only."""
    web = Client()
    web.force_login(team.engineer_a)
    calm = web.get("/models/clf/").content.decode()
    assert 'id="freeze"' not in calm and 'id="canary-form"' in calm
    burn(team.model.versions.get(version=1).pk)
    frozen = web.get("/models/clf/").content.decode()
    assert 'id="freeze"' in frozen and "Release freeze" in frozen
    assert "the availability SLO" in frozen
    # The canary form it blocks says so instead of offering a start that would get a 409.
    assert 'id="canary-form"' not in frozen and "data-frozen-form" in frozen
    assert 'id="freeze-override"' not in frozen  # an engineer cannot override
    approver = Client()
    approver.force_login(team.ann)
    assert 'id="freeze-override"' in approver.get("/models/clf/").content.decode()
    # What the form sends (static/ui/model.js): the API's override, as the approver's session.
    done = as_user(team.ann).post(
        "/api/v1/models/clf/freeze-override", {"reason": "the fix is this release", "hours": 2}
    )
    assert done.status_code == 201, done.json()
    after = web.get("/models/clf/").content.decode()
    assert "Release freeze overridden" in after and "the fix is this release" in after
    assert 'id="canary-form"' in after
    assert AuditEvent.objects.filter(action="freeze.override").get().actor_label == "ann"


def test_the_rollout_page_says_what_the_freeze_refuses(team):
    plan = start_canary(team)
    web = Client()
    web.force_login(team.engineer_a)
    assert "data-frozen-form" not in web.get(f"/rollouts/{plan.pk}/").content.decode()
    burn(plan.baseline_id)
    page = web.get(f"/rollouts/{plan.pk}/").content.decode()
    assert "data-frozen-form" in page and "the kill switch still work" in page
