"""Approvals: promotions and big weight changes need an approver who is not the requester; the
decision is one transition under row locks, with its evidence frozen; everything is audited."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections
from django.test import Client

from monitoring.models import TrafficSample
from monitoring.traffic import Counts
from rollouts import actions
from rollouts.approvals import promote_when_approved
from rollouts.models import ApprovalRequest, RolloutPlan
from tenants.audit import user_actor
from tenants.models import AuditEvent, Role
from tests.factories import (
    as_user,
    key_client,
    make_key,
    make_member,
    make_model,
    make_tenant,
    make_version,
)
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}


@pytest.fixture
def team(world, onnx_bytes):
    """Model ``clf`` in tenant A with v1 in production and v2 uploaded; two approvers."""
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes)
    make_version(model, small_onnx(seed=3), alias=None)
    world.ann = make_member(world.a, "ann", Role.APPROVER)
    world.bob = make_member(world.a, "bob", Role.APPROVER)
    world.model = model
    return world


def production(model) -> int:
    return model.aliases.get(name="production").version.version


def ask_promotion(client, version: int = 2, comment: str = "offline AUC +2 points"):
    body = {"version": version, "comment": comment}
    return client.put("/api/v1/models/clf/aliases/production", body, format="json")


def test_moving_production_is_a_promotion_request_not_a_move(team):
    response = ask_promotion(as_user(team.engineer_a))
    assert response.status_code == 202, response.json()
    body = response.json()
    assert (body["kind"], body["state"], body["from_version"], body["to_version"]) == (
        "promotion",
        "pending",
        1,
        2,
    )
    assert body["requested_by"] == "eng-a" and body["comment"] == "offline AUC +2 points"
    assert {a["arm"] for a in body["evidence"]["arms"]} == {"baseline", "candidate"}
    assert production(team.model) == 1
    again = ask_promotion(as_user(team.engineer_a))
    assert again.status_code == 409 and "open promotion request" in again.json()["error"]
    # Other aliases move directly, audited.
    staging = as_user(team.engineer_a).put(
        "/api/v1/models/clf/aliases/staging", {"version": 2}, format="json"
    )
    assert staging.status_code == 200
    assert AuditEvent.objects.filter(action="alias.move", target__endswith="@staging").exists()


def test_an_approver_other_than_the_requester_approves_and_the_alias_moves(team):
    request_id = ask_promotion(as_user(team.ann)).json()["id"]
    own = as_user(team.ann).post(f"/api/v1/approvals/{request_id}/approve", {}, format="json")
    assert own.status_code == 403 and "your own request" in own.json()["error"]
    engineer = as_user(team.engineer_a).post(f"/api/v1/approvals/{request_id}/approve")
    assert engineer.status_code == 403 and "approver role" in engineer.json()["error"]
    by_key = key_client(team.key_a).post(f"/api/v1/approvals/{request_id}/approve")
    assert by_key.status_code == 403

    approved = as_user(team.bob).post(
        f"/api/v1/approvals/{request_id}/approve", {"comment": "ship it"}, format="json"
    )
    assert approved.status_code == 200, approved.json()
    body = approved.json()
    assert (body["state"], body["decided_by"], body["decision_comment"]) == (
        "applied",
        "bob",
        "ship it",
    )
    assert production(team.model) == 2
    frozen = ApprovalRequest.objects.get(pk=request_id).evidence
    assert frozen["offline_metrics"]["candidate"] is not None and frozen["drift"] is None
    # The evidence stays as it was at the decision, whatever traffic comes later.
    TrafficSample.objects.create(
        version=team.model.versions.get(version=2),
        window_end=frozen_time(frozen),
        requests=999,
        errors=0,
        latency_buckets=Counts().buckets,
    )
    shown = as_user(team.bob).get(f"/api/v1/approvals/{request_id}").json()["evidence"]
    assert shown == frozen
    actions_logged = [e.action for e in AuditEvent.objects.filter(tenant=team.a)]
    assert actions_logged[:3] == ["approval.approve", "alias.move", "approval.request"]
    move = AuditEvent.objects.filter(action="alias.move", target__endswith="@production").first()
    assert (move.before, move.after, move.actor_label) == ({"version": 1}, {"version": 2}, "bob")


def frozen_time(evidence: dict):
    from django.utils.dateparse import parse_datetime

    return parse_datetime(evidence["at"])


def test_rejected_and_already_decided_requests(team):
    request_id = ask_promotion(as_user(team.engineer_a)).json()["id"]
    rejected = as_user(team.ann).post(
        f"/api/v1/approvals/{request_id}/reject", {"comment": "wait for A/B"}, format="json"
    )
    assert rejected.status_code == 200 and rejected.json()["state"] == "rejected"
    late = as_user(team.bob).post(f"/api/v1/approvals/{request_id}/approve")
    assert late.status_code == 409 and "already rejected" in late.json()["error"]
    assert production(team.model) == 1


def test_a_request_whose_alias_moved_since_no_longer_holds(team, onnx_bytes):
    request_id = ask_promotion(as_user(team.engineer_a)).json()["id"]
    v3 = make_version(team.model, small_onnx(seed=5), alias=None)
    from registry.services import set_alias

    set_alias(team.model, "production", v3)  # moved by another path meanwhile
    response = as_user(team.ann).post(f"/api/v1/approvals/{request_id}/approve")
    assert response.status_code == 409 and "moved since the request" in response.json()["error"]
    assert production(team.model) == 3
    assert ApprovalRequest.objects.get(pk=request_id).state == "pending"


def start_canary(client, **extra) -> int:
    body = {"mode": "canary", "candidate": 2, "weight": 5, "guardrails": GUARDRAILS, **extra}
    response = client.post("/api/v1/models/clf/rollouts", body, format="json")
    assert response.status_code == 201, response.json()
    return response.json()["id"]


def test_a_weight_beyond_the_plans_bounds_needs_an_approval(team):
    policy = {"max_weight_without_approval": 30}
    assert as_user(team.ann).put("/api/v1/policy", policy, format="json").status_code == 200
    engineer = as_user(team.engineer_a)
    plan_id = start_canary(engineer, max_weight=25)
    within = engineer.post(f"/api/v1/rollouts/{plan_id}/weight", {"weight": 25}, format="json")
    assert within.status_code == 200 and within.json()["weight"] == 25
    beyond = engineer.post(
        f"/api/v1/rollouts/{plan_id}/weight", {"weight": 60, "reason": "looks good"}, format="json"
    )
    assert beyond.status_code == 202 and beyond.json()["kind"] == "weight"
    assert RolloutPlan.objects.get(pk=plan_id).weight == 25
    decided = as_user(team.ann).post(f"/api/v1/approvals/{beyond.json()['id']}/approve")
    assert decided.status_code == 200 and decided.json()["state"] == "applied"
    assert RolloutPlan.objects.get(pk=plan_id).weight == 60


def test_promoting_production_goes_through_the_active_plan(team):
    engineer = as_user(team.engineer_a)
    plan_id = start_canary(engineer)
    direct = ask_promotion(engineer)
    assert direct.status_code == 409 and "through the plan" in direct.json()["error"]
    response = engineer.post(f"/api/v1/rollouts/{plan_id}/promotion", {"comment": "go"})
    assert response.status_code == 202 and response.json()["plan"] == plan_id
    approved = as_user(team.ann).post(f"/api/v1/approvals/{response.json()['id']}/approve")
    # Approved early: the guardrails promote once the last step is healthy past its bake.
    assert approved.status_code == 200 and approved.json()["state"] == "approved"
    assert production(team.model) == 1
    plan = RolloutPlan.objects.get(pk=plan_id)
    assert promote_when_approved(plan, "healthy past its bake time")[0] is True
    assert production(team.model) == 2
    assert ApprovalRequest.objects.get(pk=response.json()["id"]).state == "applied"


def test_stopping_a_plan_cancels_its_open_requests(team):
    engineer = as_user(team.engineer_a)
    plan_id = start_canary(engineer)
    request_id = engineer.post(f"/api/v1/rollouts/{plan_id}/promotion").json()["id"]
    assert engineer.post(f"/api/v1/rollouts/{plan_id}/kill", {"reason": "p99"}).status_code == 200
    assert ApprovalRequest.objects.get(pk=request_id).state == "cancelled"
    late = as_user(team.ann).post(f"/api/v1/approvals/{request_id}/approve")
    assert late.status_code == 409
    assert production(team.model) == 1
    assert AuditEvent.objects.filter(action="approval.cancel").count() == 1


def test_pause_and_resume(team):
    engineer = as_user(team.engineer_a)
    plan_id = start_canary(engineer)
    paused = engineer.post(f"/api/v1/rollouts/{plan_id}/pause", {"reason": "holiday"})
    assert paused.status_code == 200 and paused.json()["state"] == "paused"
    assert engineer.post(f"/api/v1/rollouts/{plan_id}/pause").status_code == 409
    assert engineer.post(f"/api/v1/rollouts/{plan_id}/resume").json()["state"] == "running"
    assert [e.action for e in AuditEvent.objects.filter(action__startswith="plan.")][:2] == [
        "plan.resume",
        "plan.pause",
    ]


def test_plan_metrics_per_arm(team):
    plan_id = start_canary(as_user(team.engineer_a))
    versions = {v.version: v for v in team.model.versions.all()}
    for number, errors in ((1, 0), (2, 3)):
        counts = Counts()
        for i in range(100):
            counts.add(0.004, ok=i >= errors)
        TrafficSample.objects.create(
            version=versions[number],
            window_end=RolloutPlan.objects.get(pk=plan_id).created_at,
            requests=counts.requests,
            errors=counts.errors,
            latency_buckets=counts.buckets,
        )
    body = as_user(team.viewer_a).get(f"/api/v1/rollouts/{plan_id}/metrics").json()
    arms = {a["arm"]: a for a in body["arms"]}
    assert arms["baseline"]["requests"] == 100 and arms["candidate"]["errors"] == 3
    assert arms["candidate"]["p99_ms"] == 5 and body["diff"]["error_rate"] == pytest.approx(0.03)


def test_key_creation_and_revocation_are_audited(world):
    from tenants.keys import revoke_api_key
    from tenants.models import ApiKey

    key = ApiKey.objects.filter(tenant=world.a).get()
    revoke_api_key(key, user_actor(world.engineer_a))
    revoke_api_key(key, user_actor(world.engineer_a))  # a second revoke changes nothing
    events = AuditEvent.objects.filter(tenant=world.a, action__startswith="key.")
    assert [e.action for e in events] == ["key.revoke", "key.create"]
    assert events[0].actor_label == "eng-a" and "revoked_at" in events[0].after


def test_viewers_cannot_request_and_other_tenants_see_nothing(team):
    viewer = as_user(team.viewer_a)
    assert ask_promotion(viewer).status_code == 403
    request_id = ask_promotion(as_user(team.engineer_a)).json()["id"]
    assert viewer.get(f"/api/v1/approvals/{request_id}").status_code == 200
    assert viewer.post(f"/api/v1/approvals/{request_id}/approve").status_code == 403
    other = key_client(team.key_b)
    assert other.get("/api/v1/approvals").json() == []
    assert other.get(f"/api/v1/approvals/{request_id}").status_code == 404
    beta_approver = make_member(team.b, "bea", Role.APPROVER)
    stranger = as_user(beta_approver, "beta")
    assert stranger.post(f"/api/v1/approvals/{request_id}/approve").status_code == 404
    assert (
        stranger.post("/api/v1/models/clf/promotions", {"version": 2}, format="json").status_code
        == 404
    )


def test_bad_input_is_a_clear_400(team):
    engineer = as_user(team.engineer_a)
    bad = engineer.get("/api/v1/approvals?state=maybe")
    assert bad.status_code == 400 and "state" in bad.json()["error"]
    missing = engineer.post("/api/v1/models/clf/promotions", {"version": 9}, format="json")
    assert missing.status_code == 404 and "no version 9" in missing.json()["error"]
    same = engineer.post("/api/v1/models/clf/promotions", {"version": 1}, format="json")
    assert same.status_code == 400 and "already points at v1" in same.json()["error"]
    assert engineer.get("/api/v1/audit?limit=0").status_code == 400
    shadow = start_canary(engineer, mode="shadow")
    not_canary = engineer.post(f"/api/v1/rollouts/{shadow}/weight", {"weight": 80})
    assert not_canary.status_code == 400 and "only canary" in not_canary.json()["error"]
    assert not ApprovalRequest.objects.filter(kind="weight").exists()


# Races: real PostgreSQL row locks, real threads, each with its own connection.

needs_postgres = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="row-lock races need PostgreSQL (DATABASE_URL)"
)


def race(*calls) -> list:
    """Run the calls at the same moment on their own threads; return results or exceptions."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def run(i, call):
        try:
            barrier.wait()
            results[i] = call()
        except Exception as error:  # the loser's exception is the result under test
            results[i] = error
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


@pytest.fixture
def live_team(transactional_db, onnx_bytes):
    tenant = make_tenant("alpha")
    make_key(tenant)
    model = make_model(tenant, "clf")
    make_version(model, onnx_bytes)
    make_version(model, small_onnx(seed=3), alias=None)
    requester = make_member(tenant, "eng", Role.ENGINEER)
    approvers = [make_member(tenant, name, Role.APPROVER) for name in ("ann", "bob")]
    return model, requester, approvers


@needs_postgres
def test_concurrent_approvals_make_exactly_one_transition(live_team):
    model, requester, (ann, bob) = live_team
    for round_ in range(3):
        ask_promotion(as_user(requester), version=2 if round_ % 2 == 0 else 1)
        request_id = ApprovalRequest.objects.get(state="pending").pk
        url = f"/api/v1/approvals/{request_id}/approve"
        codes = race(
            lambda url=url: as_user(ann).post(url).status_code,
            lambda url=url: as_user(bob).post(url).status_code,
        )
        assert sorted(codes) == [200, 409], codes
        assert AuditEvent.objects.filter(action="approval.approve").count() == round_ + 1
    assert AuditEvent.objects.filter(action="alias.move", target__endswith="@production").count()


@needs_postgres
def test_an_approval_racing_a_rollback_ends_in_one_state(live_team):
    model, requester, (ann, _) = live_team
    for _round in range(3):
        version = model.versions.get(version=2)
        plan = actions.start_plan(
            model, "canary", version, GUARDRAILS, user_actor(requester), weight=10
        )
        request_id = as_user(requester).post(f"/api/v1/rollouts/{plan.pk}/promotion").json()["id"]
        url = f"/api/v1/approvals/{request_id}/approve"
        approve_code, killed = race(
            lambda url=url: as_user(ann).post(url).status_code,
            lambda plan=plan: actions.kill(plan, user_actor(requester), "p99 breach"),
        )
        plan.refresh_from_db()
        state = ApprovalRequest.objects.get(pk=request_id).state
        assert plan.state == "rolled_back" and isinstance(killed, RolloutPlan)
        # Approved first, then the kill cancelled it; or the kill won and the approval got 409.
        assert (approve_code, state) in ((200, "cancelled"), (409, "cancelled")), (
            approve_code,
            state,
        )
        assert production(model) == 1


@needs_postgres
def test_a_promotion_racing_a_rollback_ends_in_one_state(live_team):
    model, requester, (ann, _) = live_team
    version = model.versions.get(version=2)
    plan = actions.start_plan(model, "canary", version, GUARDRAILS, user_actor(requester))
    request_id = as_user(requester).post(f"/api/v1/rollouts/{plan.pk}/promotion").json()["id"]
    assert as_user(ann).post(f"/api/v1/approvals/{request_id}/approve").status_code == 200
    promoted, killed = race(
        lambda: promote_when_approved(plan, "healthy"),
        lambda: actions.kill(plan, user_actor(requester), "p99 breach"),
    )
    plan.refresh_from_db()
    if plan.state == "promoted":
        assert promoted[0] is True and "already promoted" in str(killed)
        assert production(model) == 2
    else:
        assert plan.state == "rolled_back" and promoted[0] is False
        assert production(model) == 1
        assert ApprovalRequest.objects.get(pk=request_id).state == "cancelled"


def test_evidence_without_enough_data_says_so_instead_of_a_diff(team):
    """The measured misreading: a candidate with 0 requests showed "+0.00 pp, −5 ms, −20 ms,
    −50 ms", which reads as faster."""
    plan_id = start_canary(as_user(team.engineer_a))
    baseline = team.model.versions.get(version=1)
    counts = Counts()
    for _ in range(148):
        counts.add(0.02, ok=True)
    TrafficSample.objects.create(
        version=baseline,
        window_end=RolloutPlan.objects.get(pk=plan_id).created_at,
        requests=counts.requests,
        errors=0,
        latency_buckets=counts.buckets,
    )
    body = as_user(team.viewer_a).get(f"/api/v1/rollouts/{plan_id}/metrics").json()
    assert body["diff"] == {
        "not_enough_data": True,
        "n": {"baseline": 148, "candidate": 0},
        "need": 1,
    }
    asked = as_user(team.engineer_a).post(f"/api/v1/rollouts/{plan_id}/promotion", {})
    web = Client()
    web.force_login(team.ann)
    page = web.get(f"/approvals/{asked.json()['id']}/").content.decode()
    assert "not enough data: n = 0 (candidate), 148 (baseline)" in page
    assert "candidate − baseline" not in page
    assert "since the plan started" in page
