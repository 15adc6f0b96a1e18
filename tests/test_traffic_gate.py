"""The traffic gate (``rollouts.gate``): every change that can alter which version answers a
governed alias is judged on the routing it would produce.

The property test drives the public API as people do, an engineer with a deploy key and an
approver signed in, through random sequences of plan starts, canary weights, A/B arms, fallback
versions and timeouts, alias moves, kills, break-glass rollbacks, the guardrails' steps and
approvals. After every step it reads the routing the gateways would use (the active split's
buckets and the model's fallback) and checks it against its own record of what the approver
approved: no version the approver did not approve answers more of production than the policy's
limit, unless an approver applied that exposure and nobody raised it since; every change that
was applied wrote its audit event, and a refused one changed nothing."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from rest_framework.test import APIClient

from platform_site.errors import Forbidden
from registry import services as registry_services
from registry.models import Model
from registry.services import set_alias
from rollouts import approvals, gate, guardrails
from rollouts.approvals import GUARDRAILS as GUARDRAILS_ACTOR
from rollouts.arms import declare_ab_result
from rollouts.models import RolloutPlan
from rollouts.routing import BUCKETS, active_split
from tenants.audit import user_actor
from tenants.keys import create_api_key
from tenants.models import AuditEvent, Role
from tests.factories import as_user, key_client, make_member, make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.django_db

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}
LIMIT = 10.0  # the default policy's max_weight_without_approval
ARTIFACTS = [small_onnx(seed=n) for n in (1, 2, 3)]


def gateway_shares(model: Model, alias: str = "production") -> dict[int, float]:
    """Each version's percent of ``alias``'s answers as the gateways route them: the active
    split's bucket ranges (a point past the last bound goes to the last arm), else the alias."""
    split = active_split(model.tenant_id, model.name, alias)
    if split is None:
        current = model.aliases.get(name=alias).version_id
        return {current: 100.0}
    shares: dict[int, float] = {}
    lower = 0
    for arm, bound in zip(split.arms, split.bounds, strict=True):
        shares[arm.version_id] = shares.get(arm.version_id, 0) + max(0, bound - lower)
        lower = max(lower, bound)
    last = split.arms[-1].version_id
    shares[last] = shares.get(last, 0) + BUCKETS - lower
    return {v: n * 100 / BUCKETS for v, n in shares.items() if n}


def unapproved_exposure(model: Model, approved: set[int]) -> float:
    """The percent of production's answers that could come from versions not in ``approved``:
    a fallback outside it answers all of them when the primary fails."""
    model.refresh_from_db()
    if model.fallback_version_id is not None and model.fallback_version_id not in approved:
        return 100.0
    return sum(s for v, s in gateway_shares(model).items() if v not in approved)


class GovernedProduction(RuleBasedStateMachine):
    """One model per example: v1 in production, v2 and v3 uploaded and unreviewed."""

    team: Any = None  # set by the test: tenant, engineer key, approver

    @initialize()
    def fresh_model(self) -> None:
        GovernedProduction.serial += 1
        self.name = f"gated{GovernedProduction.serial}"
        self.model = make_model(self.team.a, self.name)
        self.versions = {
            n: make_version(self.model, ARTIFACTS[n - 1], alias=None) for n in (1, 2, 3)
        }
        set_alias(self.model, "production", self.versions[1])
        self.approved = {self.versions[1].pk}  # what the approver approved, by our own record
        self.ceiling = 0.0  # the exposure an approver applied, as lowered since
        self.engineer: APIClient = key_client(self.team.deploy_key)
        self.approver: APIClient = as_user(self.team.ann)

    serial = 0

    # The engineer's changes -------------------------------------------------------------------

    def call(self, client: APIClient, method: str, path: str, body: Any = None) -> Any:
        """One API call; checks what it wrote to the audit log against what it answered."""
        last = AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        response = getattr(client, method)(path, body, format="json")
        assert response.status_code < 500, (path, body, response.content)
        actions = set(AuditEvent.objects.filter(pk__gt=last).values_list("action", flat=True))
        if response.status_code >= 400:
            assert not actions, f"{path} refused ({response.status_code}) but wrote {actions}"
        elif response.status_code == 202:
            assert "approval.request" in actions, (path, actions)
        else:
            assert actions, f"{path} applied a change ({response.status_code}) with no audit event"
        self.last_actions = actions
        return response

    def plan(self) -> RolloutPlan | None:
        return gate.active_plan(self.model, "production")

    @rule(
        candidate=st.sampled_from([2, 3]),
        weight=st.sampled_from([0, 1, 5, 10, 11, 30, 50, 100]),
    )
    def start_canary(self, candidate: int, weight: float) -> None:
        body = {
            "mode": "canary",
            "candidate": candidate,
            "weight": weight,
            "guardrails": GUARDRAILS,
        }
        self.call(self.engineer, "post", f"/api/v1/models/{self.name}/rollouts", body)

    @rule(
        arms=st.lists(
            st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([0, 5, 10, 40, 90])),
            min_size=1,
            max_size=7,
        ),
        candidate=st.sampled_from([2, 3]),
    )
    def start_ab(self, arms: list[tuple[int, float]], candidate: int) -> None:
        body = {
            "mode": "ab",
            "candidate": candidate,
            "guardrails": GUARDRAILS,
            "arms": [
                {"name": f"arm{n}", "version": v, "weight": w} for n, (v, w) in enumerate(arms)
            ],
        }
        self.call(self.engineer, "post", f"/api/v1/models/{self.name}/rollouts", body)

    @rule(weight=st.sampled_from([0, 1, 5, 10, 11, 25, 50, 100]))
    def set_weight(self, weight: float) -> None:
        plan = self.plan()
        if plan is not None:
            self.call(
                self.engineer, "post", f"/api/v1/rollouts/{plan.pk}/weight", {"weight": weight}
            )

    @rule(weights=st.lists(st.sampled_from([0, 1, 5, 10, 40, 90, 100]), min_size=7, max_size=7))
    def set_arms(self, weights: list[float]) -> None:
        plan = self.plan()
        if plan is not None and plan.mode == "ab":
            names = sorted(a.name for a in plan.arms.all())
            body = {"arms": dict(zip(names, weights, strict=False))}
            self.call(self.engineer, "post", f"/api/v1/rollouts/{plan.pk}/arms", body)

    @rule(
        version=st.sampled_from([None, 1, 2, 3]),
        timeout=st.sampled_from([None, 1, 100]),
    )
    def set_fallback(self, version: int | None, timeout: int | None) -> None:
        body = {"fallback_version": version, "primary_timeout_ms": timeout}
        self.call(self.engineer, "patch", f"/api/v1/models/{self.name}", body)

    @rule(version=st.sampled_from([1, 2, 3]))
    def move_production(self, version: int) -> None:
        body = {"version": version, "comment": "move"}
        self.call(self.engineer, "put", f"/api/v1/models/{self.name}/aliases/production", body)

    @rule()
    def kill(self) -> None:
        plan = self.plan()
        if plan is not None:
            self.call(self.engineer, "post", f"/api/v1/rollouts/{plan.pk}/kill", {"reason": "x"})

    @rule(version=st.sampled_from([None, 1, 2, 3]))
    def rollback(self, version: int | None) -> None:
        path = f"/api/v1/models/{self.name}/aliases/production/rollback"
        self.call(self.engineer, "post", path, {"to_version": version, "reason": "bad release"})

    @rule()
    def ask_promotion(self) -> None:
        plan = self.plan()
        if plan is not None:
            self.call(self.engineer, "post", f"/api/v1/rollouts/{plan.pk}/promotion", {})

    @rule(step=st.sampled_from([5, 25, 50, 100]))
    def guardrails_step(self, step: float) -> None:
        """The guardrails found the current step healthy and advance (the Celery task's call)."""
        plan = self.plan()
        if plan is not None and plan.mode == "canary" and plan.state == "running":
            approvals.advance_or_ask(plan, step, "healthy")

    @rule(data=st.data())
    def guardrails_declare_an_ab_winner(self, data: st.DataObject) -> None:
        """The guardrails declared an A/B plan's winner (any arm) and look again: a winning
        candidate is promoted once an approver approved its promotion (promote_ab_winner)."""
        plan = self.plan()
        if plan is None or plan.mode != "ab" or plan.state != "running":
            return
        winner = data.draw(st.sampled_from(sorted(a.name for a in plan.arms.all())))
        declare_ab_result(plan, GUARDRAILS_ACTOR, winner, "error rate", "declared by the test")
        plan.refresh_from_db()
        guardrails.evaluate_ab(plan, timezone.now())

    # The approver's decisions -----------------------------------------------------------------

    @rule(data=st.data(), approve=st.booleans())
    def decide(self, data: st.DataObject, approve: bool) -> None:
        pending = self.approver.get("/api/v1/approvals", {"state": "pending"}).json()
        pending = [r for r in pending if r["model"] == self.name]
        if not pending:
            return
        req = data.draw(st.sampled_from(pending))
        verb = "approve" if approve else "reject"
        response = self.call(self.approver, "post", f"/api/v1/approvals/{req['id']}/{verb}", {})
        if approve and response.status_code == 200:
            if req["kind"] == "promotion":
                self.approved.add(self.versions[req["to_version"]].pk)
            else:  # the weight or arms asked for, applied: the approver's own exposure
                self.ceiling = unapproved_exposure(self.model, self.approved)

    # What must hold after every step ----------------------------------------------------------

    @invariant()
    def no_unapproved_version_answers_more_than_the_limit(self) -> None:
        if not hasattr(self, "model"):
            return
        exposure = unapproved_exposure(self.model, self.approved)
        assert exposure <= max(LIMIT, self.ceiling) + 0.01, (
            f"{exposure:g} % of production could come from versions the approver did not "
            f"approve (limit {LIMIT:g} %, approver applied {self.ceiling:g} %)"
        )
        self.ceiling = min(self.ceiling, exposure)


@pytest.fixture
def team(world):
    world.ann = make_member(world.a, "ann", Role.APPROVER)
    _key, world.deploy_key = create_api_key(
        world.a, "eng's deploy key", user_actor(world.engineer_a), scopes=["predict", "deploy"]
    )
    return world


def test_no_sequence_of_changes_gets_around_the_gate(team):
    GovernedProduction.team = team
    test_case = GovernedProduction.TestCase
    test_case.settings = settings(
        max_examples=25,
        stateful_step_count=20,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    test_case().runTest()


# Single changes, named ----------------------------------------------------------------------


def test_a_fallback_must_be_approved_for_production(team):
    model = make_model(team.a, "clf")
    v1 = make_version(model, ARTIFACTS[0])
    make_version(model, ARTIFACTS[1], alias=None)
    engineer = key_client(team.deploy_key)
    refused = engineer.patch(
        "/api/v1/models/clf", {"fallback_version": 2, "primary_timeout_ms": 1}, format="json"
    )
    assert refused.status_code == 403
    assert "v2 is not approved for 'production'" in refused.json()["error"]
    # An approved promotion makes v2 approved for production before it lands.
    asked = engineer.put(
        "/api/v1/models/clf/aliases/production", {"version": 2, "comment": "v2"}, format="json"
    )
    assert asked.status_code == 202
    assert (
        as_user(team.ann).post(f"/api/v1/approvals/{asked.json()['id']}/approve").status_code == 200
    )
    model.refresh_from_db()
    assert model.aliases.get(name="production").version.version == 2
    # v1, production's last-known-good, may be the fallback.
    ok = engineer.patch("/api/v1/models/clf", {"fallback_version": 1}, format="json")
    assert ok.status_code == 200 and ok.json()["fallback_version"] == 1
    assert AuditEvent.objects.filter(action="model.update").count() == 1
    assert v1.pk in gate.approved_versions(model, "production")


def test_a_model_without_a_protected_alias_takes_any_fallback(team):
    model = make_model(team.a, "clf")
    make_version(model, ARTIFACTS[0], alias="staging")
    make_version(model, ARTIFACTS[1], alias=None)
    ok = key_client(team.deploy_key).patch(
        "/api/v1/models/clf", {"fallback_version": 2}, format="json"
    )
    assert ok.status_code == 200, ok.content


def test_the_ladder_cannot_change_around_the_gate(team):
    model = make_model(team.a, "clf")
    make_version(model, ARTIFACTS[0])
    make_version(model, ARTIFACTS[1], alias=None)
    with pytest.raises(Forbidden, match="traffic gate"):
        registry_services.update_model_settings(model, {"fallback_version": 2})
    with pytest.raises(Forbidden, match="traffic gate"):
        registry_services.update_model_settings(model, {"primary_timeout_ms": 1})
    # Other settings change as before.
    registry_services.update_model_settings(model, {"description": "fine"})


def test_the_admin_shows_the_ladder_read_only(admin_client, team):
    model = make_model(team.a, "clf")
    make_version(model, ARTIFACTS[0])
    page = admin_client.get(f"/admin/registry/model/{model.pk}/change/")
    assert page.status_code == 200
    assert 'name="fallback_version"' not in page.content.decode()
    assert 'name="primary_timeout_ms"' not in page.content.decode()


def test_an_approved_promotion_lets_the_guardrails_step_to_100(team):
    model = make_model(team.a, "clf")
    make_version(model, ARTIFACTS[0])
    make_version(model, ARTIFACTS[1], alias=None)
    engineer = key_client(team.deploy_key)
    body = {"mode": "canary", "candidate": 2, "weight": 5, "guardrails": GUARDRAILS}
    plan_id = engineer.post("/api/v1/models/clf/rollouts", body, format="json").json()["id"]
    plan = RolloutPlan.objects.get(pk=plan_id)
    assert approvals.advance_or_ask(plan, 50, "healthy")[0] == "hold"
    asked = engineer.post(f"/api/v1/rollouts/{plan_id}/promotion", {}, format="json")
    assert (
        as_user(team.ann).post(f"/api/v1/approvals/{asked.json()['id']}/approve").status_code == 200
    )
    plan.refresh_from_db()
    assert approvals.advance_or_ask(plan, 100, "healthy")[0] == "advance"
    assert gateway_shares(model) == {model.versions.get(version=2).pk: 100.0}
