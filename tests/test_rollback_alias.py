"""Alias history, the last-known-good kept warm, and the break-glass rollback.

Before: an alias's moves were only audit rows; the version an alias left was unloaded 30 s
after a promotion; moving production back needed an approver and a cold load. Here every move
is an ``AliasChange`` written with the move; the version left stays in what agents serve for
``SWITCHYARD_ROLLBACK_WARM_S`` (or the model's own ``rollback_warm_s``); an engineer alone rolls
an alias back in one audited action that kills its plan, raises an alert and waits for an
approver's review.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from monitoring.models import Alert, AlertKind
from registry.models import AliasChange
from registry.services import served_versions, set_alias
from rollouts.actions import start_plan
from rollouts.models import ApprovalRequest, PlanState, RolloutPlan
from rollouts.routing import active_split
from tenants.audit import Actor
from tenants.models import AuditEvent, Role
from tests.factories import as_user, key_client, make_member, make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}
HISTORY = "/api/v1/models/clf/aliases/production/history"
ROLLBACK = "/api/v1/models/clf/aliases/production/rollback"


@pytest.fixture
def team(world, onnx_bytes):
    """Model ``clf`` of tenant A: production moved v1 → v2 by an approver (``ann``), v3
    uploaded and never on production; a second approver ``bob``."""
    model = make_model(world.a, "clf")
    world.v1 = make_version(model, onnx_bytes)
    world.v2 = make_version(model, small_onnx(seed=3), alias=None)
    world.v3 = make_version(model, small_onnx(seed=4), alias=None)
    world.ann = make_member(world.a, "ann", Role.APPROVER)
    world.bob = make_member(world.a, "bob", Role.APPROVER)
    set_alias(model, "production", world.v2, Actor(world.ann.pk, "ann", Role.APPROVER), "ship v2")
    world.model = model
    return world


def production(model) -> int:
    return model.aliases.get(name="production").version.version


# History ------------------------------------------------------------------------------------


def test_every_alias_move_is_recorded_with_who_why_and_when(team):
    history = as_user(team.viewer_a).get(HISTORY)
    assert history.status_code == 200
    rows = history.json()
    assert [(r["from_version"], r["to_version"]) for r in rows] == [(1, 2), (None, 1)]
    assert rows[0]["actor"] == "ann" and rows[0]["reason"] == "ship v2"
    assert rows[0]["break_glass"] is False and rows[0]["needs_review"] is False
    # The same transaction as the audit event: one row per alias.move event.
    assert AliasChange.objects.count() == AuditEvent.objects.filter(action="alias.move").count()


def test_history_is_tenant_scoped_and_names_an_unknown_alias(team, world):
    assert key_client(world.key_b).get(HISTORY).status_code == 404
    unknown = as_user(team.engineer_a).get("/api/v1/models/clf/aliases/nope/history")
    assert unknown.status_code == 404 and "'nope'" in unknown.json()["error"]


# The last-known-good stays warm -------------------------------------------------------------


def served(tenant_id=None) -> set[int]:
    return set(served_versions(tenant_id).values_list("version", flat=True))


def test_the_version_an_alias_left_stays_served_for_the_warm_window(team, settings):
    settings.SWITCHYARD_ROLLBACK_WARM_S = 3600
    assert served(team.a.pk) == {1, 2}  # v1 is production's last-known-good
    assert served(team.b.pk) == set()  # and only in its own tenant's scope
    # An hour and a minute later it is no longer kept.
    AliasChange.objects.update(at=AliasChange.objects.first().at - timedelta(seconds=3660))
    assert served(team.a.pk) == {2}


def test_a_models_own_warm_window_overrides_the_setting(team, settings):
    settings.SWITCHYARD_ROLLBACK_WARM_S = 3600
    team.model.rollback_warm_s = 0
    team.model.save()
    assert served() == {2}
    team.model.rollback_warm_s = 7200
    team.model.save()
    settings.SWITCHYARD_ROLLBACK_WARM_S = 0
    AliasChange.objects.update(at=AliasChange.objects.first().at - timedelta(seconds=3660))
    assert served() == {1, 2}


def test_the_warm_window_is_a_model_setting_over_the_api(team):
    client = as_user(team.engineer_a)
    response = client.patch("/api/v1/models/clf", {"rollback_warm_s": 600}, format="json")
    assert response.status_code == 200 and response.json()["rollback_warm_s"] == 600
    too_long = client.patch("/api/v1/models/clf", {"rollback_warm_s": 10**9}, format="json")
    assert too_long.status_code == 400 and "rollback_warm_s" in too_long.json()["error"]


# Break-glass rollback -----------------------------------------------------------------------


def test_an_engineer_alone_rolls_back_production_in_one_audited_action(team):
    response = as_user(team.engineer_a).post(ROLLBACK, {"reason": "p99 doubled"})
    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["from_version"], body["to_version"], body["break_glass"]) == (2, 1, True)
    assert body["needs_review"] is True and body["actor"] == "eng-a"
    assert production(team.model) == 1
    assert not ApprovalRequest.objects.exists()  # no approval asked: break-glass
    event = AuditEvent.objects.get(action="alias.rollback")
    assert (event.before, event.after) == ({"version": 2}, {"version": 1, "break_glass": True})
    assert event.actor_label == "eng-a" and event.reason == "p99 doubled"
    alert = Alert.objects.get(kind=AlertKind.ROLLBACK, resolved_at=None)
    assert "break-glass rollback by eng-a" in alert.title and "needs review" in alert.title
    history = as_user(team.viewer_a).get(HISTORY).json()
    assert history[0]["break_glass"] is True and history[0]["reason"] == "p99 doubled"


def test_a_rollback_kills_the_active_plan_on_that_alias_first(team):
    engineer = Actor(team.engineer_a.pk, "eng-a", Role.ENGINEER)
    plan = start_plan(team.model, "canary", team.v3, GUARDRAILS, engineer, weight=5)
    response = key_client(team.key_a).post(ROLLBACK, {})
    assert response.status_code == 200, response.json()
    plan.refresh_from_db()
    assert plan.state == PlanState.ROLLED_BACK
    assert active_split(team.a.pk, "clf", "production") is None
    assert production(team.model) == 1
    actions = list(AuditEvent.objects.order_by("pk").values_list("action", flat=True))
    assert actions[-2:] == ["plan.kill", "alias.rollback"]
    assert "rolled back to v1" in RolloutPlan.objects.get().status_note


def test_rolling_back_twice_is_a_409_unless_an_older_version_is_named(team):
    client = as_user(team.engineer_a)
    assert client.post(ROLLBACK, {}).status_code == 200
    again = client.post(ROLLBACK, {})
    assert again.status_code == 409 and "already rolled back to v1" in again.json()["error"]
    assert production(team.model) == 1
    same = client.post(ROLLBACK, {"to_version": 1})
    assert same.status_code == 409 and "already points at v1" in same.json()["error"]
    # Forward again to v2 is allowed too: production pointed at it before.
    assert client.post(ROLLBACK, {"to_version": 2}).json()["to_version"] == 2


def test_only_a_version_the_alias_pointed_at_before_is_a_rollback_target(team):
    client = as_user(team.engineer_a)
    never = client.post(ROLLBACK, {"to_version": 3})
    assert never.status_code == 400 and "never pointed at v3" in never.json()["error"]
    missing = client.post(ROLLBACK, {"to_version": 99})
    assert missing.status_code == 400 and "no version 99" in missing.json()["error"]
    hostile = client.post(ROLLBACK, {"to_version": "two"})
    assert hostile.status_code == 400 and "to_version" in hostile.json()["error"]
    assert production(team.model) == 2


def test_a_fresh_alias_has_nothing_to_roll_back_to(team, onnx_bytes):
    set_alias(team.model, "staging", team.v3)
    response = as_user(team.engineer_a).post("/api/v1/models/clf/aliases/staging/rollback", {})
    assert (
        response.status_code == 409
        and "never pointed at another version" in (response.json()["error"])
    )


def test_a_viewer_cannot_roll_back_and_another_tenant_is_not_found(team, world):
    viewer = as_user(team.viewer_a).post(ROLLBACK, {})
    assert viewer.status_code == 403
    beta = key_client(world.key_b).post(ROLLBACK, {})
    assert beta.status_code == 404
    unknown = as_user(team.engineer_a).post("/api/v1/models/clf/aliases/nope/rollback", {})
    assert unknown.status_code == 404 and "'nope'" in unknown.json()["error"]
    assert (
        production(team.model) == 2
        and not AuditEvent.objects.filter(action="alias.rollback").exists()
    )


# Review -------------------------------------------------------------------------------------


def review_url(change_id: int) -> str:
    return f"{HISTORY}/{change_id}/review"


def test_an_approver_other_than_the_author_reviews_the_rollback(team):
    change = as_user(team.ann).post(ROLLBACK, {"reason": "bad"}).json()["id"]
    engineer = as_user(team.engineer_a).post(review_url(change), {})
    assert engineer.status_code == 403 and "approver role" in engineer.json()["error"]
    own = as_user(team.ann).post(review_url(change), {})
    assert own.status_code == 403 and "your own rollback" in own.json()["error"]
    reviewed = as_user(team.bob).post(review_url(change), {"comment": "right call"})
    assert reviewed.status_code == 200
    body = reviewed.json()
    assert body["reviewed_by"] == "bob" and body["review_comment"] == "right call"
    assert body["needs_review"] is False
    assert AuditEvent.objects.filter(action="alias.review", actor_label="bob").exists()
    assert not Alert.objects.filter(kind=AlertKind.ROLLBACK, resolved_at=None).exists()
    twice = as_user(team.bob).post(review_url(change), {})
    assert twice.status_code == 409 and "already reviewed by bob" in twice.json()["error"]


def test_review_is_only_for_break_glass_rows_and_tenant_scoped(team, world):
    ordinary = AliasChange.objects.filter(break_glass=False).first()
    plain = as_user(team.bob).post(review_url(ordinary.pk), {})
    assert plain.status_code == 409
    change = as_user(team.engineer_a).post(ROLLBACK, {}).json()["id"]
    beta_approver = make_member(world.b, "bea", Role.APPROVER)
    assert as_user(beta_approver, "beta").post(review_url(change), {}).status_code == 404
    wrong_alias = f"/api/v1/models/clf/aliases/staging/history/{change}/review"
    assert as_user(team.bob).post(wrong_alias, {}).status_code == 404


# The alias page -----------------------------------------------------------------------------


def page_of(client, user, path: str = "/models/clf/aliases/production/"):
    client.force_login(user)
    return client.get(path)


def test_the_alias_page_lists_the_history_and_offers_the_rollback(team, client):
    as_user(team.engineer_a).post(ROLLBACK, {"reason": "p99 doubled"})
    response = page_of(client, team.engineer_a)
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="current-version">v1<' in html
    assert "p99 doubled" in html and "break-glass" in html and "needs review" in html
    assert "ship v2" in html  # the earlier promotion by ann
    assert 'id="rollback-button"' in html and '<option value="2"' in html
    assert "Mark reviewed" not in html  # an engineer does not review


def test_the_alias_page_offers_the_review_to_another_approver_only(team, client):
    as_user(team.ann).post(ROLLBACK, {})
    assert "data-review=" not in page_of(client, team.ann).content.decode()  # her own
    assert "data-review=" in page_of(client, team.bob).content.decode()


def test_a_viewer_sees_no_rollback_button_and_another_tenant_gets_404(team, client, world):
    html = page_of(client, team.viewer_a).content.decode()
    assert 'id="rollback-button"' not in html and "Viewers cannot roll back" in html
    beta = make_member(world.b, "bea", Role.ENGINEER)
    assert page_of(client, beta).status_code == 404
    assert page_of(client, team.engineer_a, "/models/clf/aliases/nope/").status_code == 404


def test_the_model_page_links_each_alias_to_its_history(team, client):
    html = page_of(client, team.engineer_a, "/models/clf/").content.decode()
    assert 'href="/models/clf/aliases/production/"' in html


@pytest.mark.parametrize("alias", ["nul%00x", "UPPER", "2", "x" * 300])
def test_a_name_no_alias_can_have_is_a_404_on_every_alias_endpoint(team, client, alias):
    user = as_user(team.bob)
    base = f"/api/v1/models/clf/aliases/{alias}"
    assert user.get(f"{base}/history").status_code == 404
    assert user.post(f"{base}/rollback", {}).status_code == 404
    assert user.post(f"{base}/history/1/review", {}).status_code == 404
    assert page_of(client, team.engineer_a, f"/models/clf/aliases/{alias}/").status_code == 404
