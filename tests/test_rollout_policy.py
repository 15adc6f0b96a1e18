"""The rollout policy bounds traffic, not the requester: an unreviewed start, an A/B arm and the
guardrails' steps stop at its limit and ask; N of M approvers; no self-approval through a key
and no decision with one; the Django admin moves aliases only through the same rules."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from monitoring.models import TrafficSample
from monitoring.traffic import Counts
from platform_site.errors import Forbidden
from rollouts import actions, approvals
from rollouts.guardrails import evaluate
from rollouts.models import ApprovalRequest, ApprovalVote, RolloutPlan, RolloutPolicy
from rollouts.routing import active_split
from tenants.audit import Actor, user_actor
from tenants.keys import create_api_key
from tenants.models import AuditEvent, Role
from tests.factories import as_user, key_client, make_member, make_model, make_version
from tests.onnx_models import small_onnx
from web.snapshots import plan_snapshot

pytestmark = pytest.mark.backends

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}


def key_actor(key, role: str = Role.ENGINEER) -> Actor:
    """A call made with ``key``, as the keys' authentication describes it: the key's creator
    as user id, the key's id as ``via_key``."""
    return Actor(key.created_by_id, f"api-key:{key.pk}", role, via_key=key.pk)


@pytest.fixture
def team(world, onnx_bytes):
    """Model ``clf`` in tenant A: v1 in production, v2 and v3 uploaded; three approvers."""
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes)
    make_version(model, small_onnx(seed=3), alias=None)
    make_version(model, small_onnx(seed=4), alias=None)
    world.ann = make_member(world.a, "ann", Role.APPROVER)
    world.bob = make_member(world.a, "bob", Role.APPROVER)
    world.cat = make_member(world.a, "cat", Role.APPROVER)
    world.model = model
    return world


def start(client, **extra):
    body = {"mode": "canary", "candidate": 2, "weight": 5, "guardrails": GUARDRAILS, **extra}
    return client.post("/api/v1/models/clf/rollouts", body, format="json")


def production(model) -> int:
    return model.aliases.get(name="production").version.version


# An unreviewed start ---------------------------------------------------------------------------


def test_an_unreviewed_100_percent_start_is_sent_for_approval(team):
    response = start(as_user(team.engineer_a), weight=100, max_weight=100)
    assert response.status_code == 202, response.json()
    body = response.json()
    assert (body["kind"], body["weight"], body["state"]) == ("weight", 100, "pending")
    plan = RolloutPlan.objects.get(pk=body["plan"])
    # Started at the policy's limit, its own max_weight capped by it: never 100 % unreviewed.
    assert (plan.weight, plan.max_weight) == (10, 10)
    split = active_split(team.a.pk, "clf", "production")
    assert [(a.name, a.weight) for a in split.arms] == [("baseline", 90), ("candidate", 10)]
    assert AuditEvent.objects.filter(action="approval.request").get().actor_label == "eng-a"
    approved = as_user(team.ann).post(f"/api/v1/approvals/{body['id']}/approve")
    assert approved.status_code == 200 and approved.json()["state"] == "applied"
    plan.refresh_from_db()
    assert plan.weight == 100


def test_a_weight_above_the_policy_is_a_request_whatever_max_weight_was_asked(team):
    plan_id = start(as_user(team.engineer_a), max_weight=80).json()["id"]
    assert RolloutPlan.objects.get(pk=plan_id).max_weight == 10
    moved = as_user(team.engineer_a).post(f"/api/v1/rollouts/{plan_id}/weight", {"weight": 50})
    assert moved.status_code == 202 and moved.json()["kind"] == "weight"
    assert RolloutPlan.objects.get(pk=plan_id).weight == 5


def answers_from(split, keys: int = 2000) -> dict[int, float]:
    """Each version's percent of ``keys`` routing keys, as the gateways choose arms."""
    counts: dict[int, int] = {}
    for n in range(keys):
        version_id = split.choose(f"user-{n}").version_id
        counts[version_id] = counts.get(version_id, 0) + 1
    return {v: c * 100 / keys for v, c in counts.items()}


def test_ab_arms_on_unreviewed_versions_are_summed_by_the_traffic_gate(team):
    """The measured bypass: a 40 % baseline arm and six 10 % arms on an unreviewed version,
    each arm within the 10 % limit, 60 % of production in all."""
    v1, v2 = (team.model.versions.get(version=n).pk for n in (1, 2))
    arms = [{"name": "base", "version": 1, "weight": 40}]
    arms += [{"name": f"c{n}", "version": 2, "weight": 10} for n in range(6)]
    engineer = as_user(team.engineer_a)
    asked = start(engineer, mode="ab", arms=arms)
    assert asked.status_code == 202, asked.json()
    body = asked.json()
    assert body["kind"] == "arms" and body["state"] == "pending"
    assert body["arm_weights"] == {a["name"]: a["weight"] for a in arms}
    assert "60 %" in body["comment"] and "10 %" in body["comment"], body["comment"]
    # The rollout page lists it with the arms' weights it asks for (not as a promotion).
    (listed,) = plan_snapshot(RolloutPlan.objects.get(pk=body["plan"]))["requests"]
    assert (listed["kind"], listed["arm_weights"]) == ("arms", body["arm_weights"])
    # Started held: the unreviewed arms carry nothing until an approver says yes.
    split = active_split(team.a.pk, "clf", "production")
    assert answers_from(split) == {v1: 100.0}
    approved = as_user(team.ann).post(f"/api/v1/approvals/{body['id']}/approve")
    assert approved.status_code == 200 and approved.json()["state"] == "applied"
    split = active_split(team.a.pk, "clf", "production")
    assert 55 < answers_from(split)[v2] < 65
    # Lowering the unreviewed arms never waits; raising them again asks again.
    plan_id = body["plan"]
    lower = {"base": 70, **{f"c{n}": 5 for n in range(6)}}
    assert engineer.post(f"/api/v1/rollouts/{plan_id}/arms", {"arms": lower}).status_code == 200
    again = engineer.post(
        f"/api/v1/rollouts/{plan_id}/arms", {"arms": {a["name"]: a["weight"] for a in arms}}
    )
    assert again.status_code == 202 and again.json()["kind"] == "arms"


def test_ab_weights_within_the_limit_apply_and_above_it_ask(team):
    arms = [{"name": "a", "version": 1, "weight": 10}, {"name": "b", "version": 2, "weight": 90}]
    engineer = as_user(team.engineer_a)
    held = start(engineer, mode="ab", arms=arms)
    assert held.status_code == 202 and held.json()["kind"] == "arms"
    assert "production: 90 %" in held.json()["comment"]
    as_user(team.engineer_a).post(f"/api/v1/rollouts/{held.json()['plan']}/kill")
    # The baseline's own version may carry any share; other versions up to the limit, summed.
    arms = [{"name": "a", "version": 1, "weight": 90}, {"name": "b", "version": 2, "weight": 10}]
    started = start(engineer, mode="ab", arms=arms)
    assert started.status_code == 201, started.json()
    plan_id = started.json()["id"]
    # Weights are relative, as the gateways split them: 1 to 9 is 90 % for b.
    asked = engineer.post(f"/api/v1/rollouts/{plan_id}/arms", {"arms": {"a": 1, "b": 9}})
    assert asked.status_code == 202 and asked.json()["kind"] == "arms"
    assert asked.json()["arm_weights"] == {"a": 1, "b": 9}
    split = active_split(team.a.pk, "clf", "production")
    assert {a.name: a.weight for a in split.arms} == {"a": 90, "b": 10}
    within = engineer.post(f"/api/v1/rollouts/{plan_id}/arms", {"arms": {"a": 95, "b": 5}})
    assert within.status_code == 200, within.json()
    bad = engineer.post(f"/api/v1/rollouts/{plan_id}/arms", {"arms": {"a": 50}})
    assert bad.status_code == 400 and "each arm" in bad.json()["error"]
    approved = as_user(team.ann).post(f"/api/v1/approvals/{asked.json()['id']}/approve")
    assert approved.status_code == 200 and approved.json()["state"] == "applied"
    split = active_split(team.a.pk, "clf", "production")
    assert {a.name: a.weight for a in split.arms} == {"a": 1, "b": 9}
    assert AuditEvent.objects.filter(action="plan.arms").latest("pk").actor_label == "ann"


def test_a_zero_split_would_send_everything_to_its_first_arm_and_is_judged_so(team):
    """Weights of zeros route to the first arm (the gateways must answer): an unreviewed first
    arm at 0 % is still 100 % of production."""
    arms = [{"name": "a", "version": 2, "weight": 0}, {"name": "b", "version": 1, "weight": 0}]
    refused = start(as_user(team.engineer_a), mode="ab", arms=arms)
    assert refused.status_code == 403, refused.json()
    assert "100 %" in refused.json()["error"]
    assert not RolloutPlan.objects.exists()


def test_a_shadow_plan_moves_no_traffic_and_has_no_limit(team):
    response = start(as_user(team.engineer_a), mode="shadow", weight=0, shadow_sample=1.0)
    assert response.status_code == 201, response.json()


# The guardrails' steps -------------------------------------------------------------------------


def sample(version_id: int, requests: int = 500) -> None:
    counts = Counts()
    for _ in range(requests):
        counts.add(0.004, ok=True)
    TrafficSample.objects.create(
        version_id=version_id,
        window_end=timezone.now(),
        requests=requests,
        errors=0,
        latency_buckets=counts.buckets,
    )


def test_the_guardrails_stop_at_the_policy_limit_and_ask(team):
    plan = actions.start_plan(
        team.model,
        "canary",
        team.model.versions.get(version=2),
        GUARDRAILS,
        user_actor(team.engineer_a, Role.ENGINEER),
        weight=5,
        steps=[5, 10, 50, 100],
        bake_seconds=60,
    )
    sample(plan.baseline_id), sample(plan.candidate_id)
    later = timezone.now() + timedelta(seconds=61)
    assert evaluate(plan, now=later).action == "advance"
    plan.refresh_from_db()
    assert plan.weight == 10  # within the policy: no approval
    sample(plan.baseline_id), sample(plan.candidate_id)
    verdict = evaluate(plan, now=timezone.now() + timedelta(seconds=61))
    request = ApprovalRequest.objects.get(plan=plan, kind="weight")
    assert verdict.action == "hold"
    assert (request.weight, request.requested_label, request.state) == (50, "guardrails", "pending")
    plan.refresh_from_db()
    assert plan.weight == 10
    assert plan.status_note == (
        f"healthy at 10 %: waiting for approval to go to 50 % (request #{request.pk})"
    )
    assert evaluate(plan, now=timezone.now() + timedelta(seconds=61)).action == "hold"
    assert ApprovalRequest.objects.filter(plan=plan).count() == 1  # asks once
    approvals.approve(request, user_actor(team.ann, Role.APPROVER), "fine")
    plan.refresh_from_db()
    assert plan.weight == 50


def test_an_approved_promotion_covers_the_steps_up_to_100(team):
    engineer = user_actor(team.engineer_a, Role.ENGINEER)
    version = team.model.versions.get(version=2)
    plan, _ = approvals.start_plan(
        team.model, "canary", version, GUARDRAILS, engineer, weight=10, steps=[10, 100]
    )
    request = approvals.request_promotion(team.model, None, engineer, plan=plan)
    approvals.approve(request, user_actor(team.ann, Role.APPROVER))
    sample(plan.baseline_id), sample(plan.candidate_id)
    plan.refresh_from_db()
    assert evaluate(plan, now=timezone.now() + timedelta(seconds=301)).action == "advance"
    plan.refresh_from_db()
    assert plan.weight == 100 and not plan.requests.filter(kind="weight").exists()


def test_an_approved_promotion_lands_though_the_baseline_stops_getting_traffic(team):
    """The measured dead end: canary 5/25/50/100, the promotion and the 100 % weight approved,
    then "waiting for data: baseline 148/200" forever, since at 100 % the baseline gets no
    traffic. At 100 % the step is judged against what the baseline served during the plan."""
    engineer, ann = user_actor(team.engineer_a, Role.ENGINEER), user_actor(team.ann, Role.APPROVER)
    version = team.model.versions.get(version=2)
    plan, _ = approvals.start_plan(
        team.model, "canary", version, GUARDRAILS, engineer, weight=5, steps=[5, 25, 50, 100]
    )
    sample(plan.baseline_id, requests=148)  # all the baseline served during the plan
    request = approvals.request_promotion(team.model, None, engineer, plan=plan)
    approvals.approve(request, ann, "ship it")
    plan.refresh_from_db()
    actions.set_weight(plan, 100, engineer, "all in")  # the gate clears it: v2 is approved
    plan.refresh_from_db()
    sample(plan.candidate_id, requests=500)
    verdict = evaluate(plan, now=timezone.now() + timedelta(seconds=301))
    assert verdict.action == "promote", verdict
    assert production(team.model) == 2
    plan.refresh_from_db()
    assert plan.state == "promoted"
    assert "148 requests the baseline served during the plan" in plan.status_note


# Keys and the four-eyes rule -------------------------------------------------------------------


def test_self_approval_through_a_key_is_refused(team):
    key, _raw = create_api_key(team.a, "ann's deploy key", user_actor(team.ann))
    assert key.created_by_id == team.ann.pk
    request = approvals.request_promotion(
        team.model, team.model.versions.get(version=2), key_actor(key)
    )
    assert request.requested_by_id == team.ann.pk  # the key's requests are its creator's
    with pytest.raises(Forbidden, match="your own request"):
        approvals.approve(request, user_actor(team.ann, Role.APPROVER))
    assert approvals.approve(request, user_actor(team.bob, Role.APPROVER)).state == "applied"
    assert production(team.model) == 2


def test_self_approval_through_a_key_is_refused_over_the_api(team):
    """Through the real key authentication: the key's request is its creator's, the creator
    cannot approve it as themselves, the key cannot decide at all, another approver can."""
    _key, raw = create_api_key(
        team.a, "ann's deploy key", user_actor(team.ann), scopes=["predict", "deploy"]
    )
    asked = key_client(raw).post(
        "/api/v1/models/clf/promotions", {"version": 2, "comment": "ship it"}, format="json"
    )
    assert asked.status_code == 202, asked.json()
    approve = f"/api/v1/approvals/{asked.json()['id']}/approve"
    with_key = key_client(raw).post(approve, {"comment": "lgtm"}, format="json")
    assert with_key.status_code == 403, with_key.json()
    by_ann = as_user(team.ann).post(approve, {"comment": "lgtm"}, format="json")
    assert by_ann.status_code == 403 and "your own request" in by_ann.json()["error"]
    assert production(team.model) == 1
    by_bob = as_user(team.bob).post(approve, {"comment": "checked"}, format="json")
    assert by_bob.status_code == 200, by_bob.json()
    assert production(team.model) == 2


def test_a_key_without_an_owner_cannot_ask(team):
    key, _raw = create_api_key(team.a, "made by the platform")  # no creator: anyone's
    ownerless = key_actor(key)
    v2 = team.model.versions.get(version=2)
    with pytest.raises(Forbidden, match="no owner"):
        approvals.request_promotion(team.model, v2, ownerless)
    with pytest.raises(Forbidden, match="no owner"):
        approvals.start_plan(team.model, "canary", v2, GUARDRAILS, ownerless, weight=50)
    assert not RolloutPlan.objects.exists() and not ApprovalRequest.objects.exists()
    # Within the policy it starts as before: nothing to approve.
    plan, asked = approvals.start_plan(team.model, "canary", v2, GUARDRAILS, ownerless, weight=10)
    assert asked is None and plan.weight == 10


def test_a_decision_made_with_an_api_key_is_refused(team):
    request = approvals.request_promotion(
        team.model, team.model.versions.get(version=2), user_actor(team.engineer_a)
    )
    key, _raw = create_api_key(team.a, "bob's key", user_actor(team.bob))
    for decide in (approvals.approve, approvals.reject):
        with pytest.raises(Forbidden, match="not with an API key"):
            decide(request, key_actor(key, Role.APPROVER))
    request.refresh_from_db()
    assert request.state == "pending" and not ApprovalVote.objects.exists()


# N of M --------------------------------------------------------------------------------------


def test_two_approvals_needed_take_two_distinct_approvers(team):
    ann = as_user(team.ann)
    set_n = ann.put("/api/v1/models/clf/policy", {"approvals_needed": 2}, format="json")
    assert set_n.status_code == 200 and set_n.json()["scope"] == "model"
    engineer = as_user(team.engineer_a)
    asked = engineer.put("/api/v1/models/clf/aliases/production", {"version": 2})
    assert asked.status_code == 202 and asked.json()["approvals_needed"] == 2
    url = f"/api/v1/approvals/{asked.json()['id']}"
    first = ann.post(f"{url}/approve", {"comment": "offline ok"})
    assert first.status_code == 200 and first.json()["state"] == "pending"
    assert first.json()["approvals"] == 1 and first.json()["votes"][0]["by"] == "ann"
    assert production(team.model) == 1
    page = ann.get(f"/approvals/{asked.json()['id']}/").content.decode()
    assert "1 of 2 · ann (yes)" in page
    again = ann.post(f"{url}/approve")
    assert again.status_code == 409 and "already voted" in again.json()["error"]
    second = as_user(team.bob).post(f"{url}/approve")
    assert second.status_code == 200 and second.json()["state"] == "applied"
    assert [v["by"] for v in second.json()["votes"]] == ["ann", "bob"]
    assert production(team.model) == 2
    logged = [e.action for e in AuditEvent.objects.filter(action__startswith="approval.")]
    assert logged == ["approval.approve", "approval.vote", "approval.request"]
    # One rejection ends a request, whatever yeses it had.
    asked = engineer.put("/api/v1/models/clf/aliases/production", {"version": 3}).json()
    ann.post(f"/api/v1/approvals/{asked['id']}/approve")
    rejected = as_user(team.cat).post(f"/api/v1/approvals/{asked['id']}/reject")
    assert rejected.status_code == 200 and rejected.json()["state"] == "rejected"
    assert production(team.model) == 2


# The policy itself -----------------------------------------------------------------------------


def test_the_policy_is_set_by_approvers_only_audited_and_read_by_all(team):
    engineer = as_user(team.engineer_a)
    default = engineer.get("/api/v1/policy").json()
    assert default["scope"] == "default" and default["max_weight_without_approval"] == 10
    assert default["protected_aliases"] == ["production"] and default["approvals_needed"] == 1
    body = {"max_weight_without_approval": 25, "required_guardrails": ["max_drift_psi"]}
    assert engineer.put("/api/v1/policy", body, format="json").status_code == 403
    assert key_client(team.key_a).put("/api/v1/policy", body, format="json").status_code == 403
    assert not RolloutPolicy.objects.exists()
    set_ = as_user(team.ann).put("/api/v1/policy", {**body, "reason": "Q4"}, format="json")
    assert set_.status_code == 200 and set_.json()["updated_by"] == "ann"
    event = AuditEvent.objects.get(action="policy.set")
    assert event.before == {} and event.after["max_weight_without_approval"] == 25
    assert event.reason == "Q4" and event.actor_label == "ann"
    again = as_user(team.bob).put("/api/v1/policy", {"max_weight_without_approval": 5})
    assert again.json()["required_guardrails"] == ["max_drift_psi"]  # kept
    latest = AuditEvent.objects.filter(action="policy.set").first()
    assert (
        latest.before["max_weight_without_approval"],
        latest.after["max_weight_without_approval"],
    ) == (25, 5)
    # The model inherits the tenant's policy until it has its own.
    assert engineer.get("/api/v1/models/clf/policy").json()["scope"] == "tenant"
    # A required guardrail is required.
    missing = start(engineer)
    assert missing.status_code == 400 and "max_drift_psi" in missing.json()["error"]
    assert start(engineer, guardrails={**GUARDRAILS, "max_drift_psi": 0.2}).status_code == 201


def test_bad_policy_input_is_a_clear_400(team):
    ann = as_user(team.ann)
    for body, field in (
        ({"max_weight_without_approval": 150}, "max_weight_without_approval"),
        ({"required_guardrails": ["nope"]}, "required_guardrails"),
        ({"approvals_needed": 0}, "approvals_needed"),
        ({"approvals_needed": 4}, "approvals_needed"),  # three approvers in the tenant
        ({"protected_aliases": ["bad name!"]}, "protected_aliases"),
        ({"protected_aliases": "production"}, "protected_aliases"),
    ):
        response = ann.put("/api/v1/policy", body, format="json")
        assert response.status_code == 400, (body, response.json())
        assert field in response.json()["error"], (body, response.json())
    assert not RolloutPolicy.objects.exists()


def test_the_policy_endpoints_are_tenant_isolated(team):
    as_user(team.ann).put("/api/v1/models/clf/policy", {"max_weight_without_approval": 30})
    other_model = make_model(team.b, "theirs")
    make_version(other_model, small_onnx(seed=6))
    bea = make_member(team.b, "bea", Role.APPROVER)
    stranger = as_user(bea, "beta")
    assert stranger.get("/api/v1/models/clf/policy").status_code == 404
    put = stranger.put("/api/v1/models/clf/policy", {"max_weight_without_approval": 100})
    assert put.status_code == 404
    assert stranger.get("/api/v1/policy").json()["scope"] == "default"
    assert stranger.post("/api/v1/models/clf/freeze-override", {"reason": "x"}).status_code == 404
    assert stranger.get("/api/v1/models/clf/freeze-override").status_code == 404
    assert RolloutPolicy.objects.get().max_weight_without_approval == 30
    assert not AuditEvent.objects.filter(tenant=team.b, action="policy.set").exists()


# Any alias -------------------------------------------------------------------------------------


def test_a_plan_on_a_non_protected_alias_starts_and_moves_without_approval(team):
    engineer = as_user(team.engineer_a)
    for version in (3, 1):  # an alias other than production moves at once
        moved = engineer.put("/api/v1/models/clf/aliases/staging", {"version": version})
        assert moved.status_code == 200, moved.json()
    started = start(engineer, alias="staging", weight=100)
    assert started.status_code == 201 and started.json()["weight"] == 100
    plan = started.json()["id"]
    assert engineer.post(f"/api/v1/rollouts/{plan}/weight", {"weight": 50}).status_code == 200
    # Protected by the policy, staging is governed like production.
    as_user(team.ann).put(
        "/api/v1/policy", {"protected_aliases": ["production", "staging"]}, format="json"
    )
    over = engineer.post(f"/api/v1/rollouts/{plan}/weight", {"weight": 100})
    assert over.status_code == 202 and over.json()["alias"] == "staging"
    engineer.post(f"/api/v1/rollouts/{plan}/kill")
    asked = engineer.put("/api/v1/models/clf/aliases/staging", {"version": 2})
    assert asked.status_code == 202 and asked.json()["kind"] == "promotion"
    assert team.model.aliases.get(name="staging").version.version == 1


# The Django admin --------------------------------------------------------------------------------


@pytest.fixture
def admin_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw-root-123")
    client.force_login(user)
    return client


def test_an_admin_alias_move_is_audited_and_governed(team, admin_client):
    alias = team.model.aliases.get(name="production")
    v2 = team.model.versions.get(version=2)
    page = admin_client.post(
        f"/admin/registry/alias/{alias.pk}/change/", {"version": v2.pk}, follow=True
    )
    assert page.status_code == 200
    assert production(team.model) == 1  # protected: not moved
    request = ApprovalRequest.objects.get()
    assert (request.kind, request.requested_label, request.to_version_id) == (
        "promotion",
        "root",
        v2.pk,
    )
    assert f"promotion request #{request.pk}" in page.content.decode()
    assert AuditEvent.objects.get(action="approval.request").actor_label == "root"
    # A non-protected alias moves at once, audited with the admin as actor.
    admin_client.post(
        "/admin/registry/alias/add/", {"model": team.model.pk, "name": "staging", "version": v2.pk}
    )
    assert team.model.aliases.get(name="staging").version_id == v2.pk
    move = AuditEvent.objects.get(action="alias.move", target__endswith="@staging")
    assert move.actor_label == "root" and move.after == {"version": 2}
    # No deleting production from the admin either.
    assert admin_client.post(f"/admin/registry/alias/{alias.pk}/delete/").status_code == 403
    # A plan's weight is not editable in the admin: it changes through the API's rules.
    plan = actions.start_plan(
        team.model, "canary", v2, GUARDRAILS, user_actor(team.engineer_a), weight=5
    )
    page = admin_client.get(f"/admin/rollouts/rolloutplan/{plan.pk}/change/").content.decode()
    assert 'name="weight"' not in page and 'name="_save"' not in page
