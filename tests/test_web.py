"""The web UI's pages and live socket: sign-in required, one tenant's data per page, roles shown
as the controls a user gets, and another tenant's objects are 404."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.contrib.staticfiles import finders
from django.test import Client
from django.utils import timezone

from rollouts import actions, approvals
from tenants.audit import Actor
from tenants.members import SESSION_KEY
from tenants.models import AuditEvent, Membership
from tests.factories import make_member, make_model, make_version
from tests.onnx_models import small_onnx
from web.live import LiveConsumer

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}


def make_plan(tenant, name: str, onnx_bytes: bytes, **options):
    """A model with v1 in production, v2 uploaded, and a canary plan from v1 to v2."""
    model = make_model(tenant, name)
    make_version(model, onnx_bytes, offline_metrics={"auc": 0.91}, source_commit="3f2a9c1")
    candidate = make_version(model, small_onnx(seed=3), alias=None)
    return actions.start_plan(
        model, "canary", candidate, GUARDRAILS, Actor(None, "test"), weight=5, **options
    )


def actor(user, role: str) -> Actor:
    return Actor(user.pk, user.get_username(), role)


@pytest.fixture
def site(world, onnx_bytes):
    """Tenant A: plan on ``clf`` and a promotion request by its engineer; tenant B: the same on
    ``secret-b``, so every page can be checked for what it must not show."""
    approver = make_member(world.a, "approver-a", "approver")
    plan_a = make_plan(world.a, "clf", onnx_bytes)
    plan_b = make_plan(world.b, "secret-b", onnx_bytes)
    engineer_b = make_member(world.b, "eng-b", "engineer")
    req_a = approvals.request_promotion(
        plan_a.model, None, actor(world.engineer_a, "engineer"), comment="ship it", plan=plan_a
    )
    req_b = approvals.request_promotion(
        plan_b.model, None, actor(engineer_b, "engineer"), plan=plan_b
    )
    world.approver_a = approver
    world.plan_a, world.plan_b, world.req_a, world.req_b = plan_a, plan_b, req_a, req_b
    return world


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


PAGES = ["/", "/models/clf/", "/rollouts/1/", "/approvals/", "/approvals/1/", "/audit/"]


@pytest.mark.parametrize("url", PAGES)
def test_every_page_requires_sign_in(db, url):
    response = Client().get(url)
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_sign_in_and_out(world):
    client = Client()
    assert b"Sign in" in client.get("/login/").content
    bad = client.post("/login/", {"username": "eng-a", "password": "wrong"})
    assert bad.status_code == 200 and b"Wrong username or password" in bad.content
    good = client.post("/login/", {"username": "eng-a", "password": "pw-eng-a-1"})
    assert good.status_code == 302 and good["Location"] == "/"
    assert client.get("/").status_code == 200
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302


def test_dashboard_shows_the_tenants_models_and_live_split_only(site):
    response = signed_in(site.engineer_a).get("/")
    assert response.status_code == 200
    snapshot = response.context["snapshot"]
    assert [m["name"] for m in snapshot["models"]] == ["clf"]
    (production,) = snapshot["models"][0]["aliases"]
    assert production["plan"] == {"id": site.plan_a.pk, "mode": "canary", "candidate": 2}
    assert production["split"] == [
        {"arm": "baseline", "version": 1, "weight": 95.0},
        {"arm": "candidate", "version": 2, "weight": 5.0},
    ]
    assert set(snapshot["models"][0]["summary"]) >= {"rps", "error_rate", "p99_ms"}
    assert b"secret-b" not in response.content
    assert b'<span class="count" data-pending-count>1</span>' in response.content


def test_model_page_shows_versions_signature_lineage_and_aliases(site):
    content = signed_in(site.engineer_a).get("/models/clf/").content.decode()
    assert "v1" in content and "v2" in content and "production" in content
    assert "in <b>x</b> FP32 [-1, 4]" in content and "out <b>y</b> FP32 [-1, 2]" in content
    assert "3f2a9c1" in content and "auc <b>0.91</b>" in content
    assert f"/rollouts/{site.plan_a.pk}/" in content


def test_rollout_page_gives_engineers_the_slider_and_viewers_a_disabled_one(site):
    url = f"/rollouts/{site.plan_a.pk}/"
    engineer = signed_in(site.engineer_a).get(url).content.decode()
    viewer = signed_in(site.viewer_a).get(url).content.decode()
    slider = 'type="range" id="weight" min="0" max="100" step="1" value="5"'
    assert slider in engineer and slider in viewer
    assert 'aria-label="Candidate weight" disabled' in viewer
    assert 'aria-label="Candidate weight" disabled' not in engineer
    assert 'data-action="kill"' in engineer and 'data-action="kill"' not in viewer
    assert "up to 10 % directly" in engineer  # the rollout policy's default
    assert 'id="snapshot"' in engineer and "vendor/plotly.min.js" in engineer


@pytest.mark.parametrize(
    "url",
    [
        "/models/secret-b/",
        "/rollouts/{plan_b}/",
        "/approvals/{req_b}/",
    ],
)
def test_other_tenant_gets_404(site, url):
    url = url.format(plan_b=site.plan_b.pk, req_b=site.req_b.pk)
    assert signed_in(site.engineer_a).get(url).status_code == 404


def test_inbox_lists_the_tenants_pending_requests(site):
    response = signed_in(site.approver_a).get("/approvals/")
    assert [r.pk for r in response.context["pending"]] == [site.req_a.pk]
    assert b"secret-b" not in response.content


def test_an_approver_who_did_not_ask_gets_the_decision_buttons(site):
    url = f"/approvals/{site.req_a.pk}/"
    approver = signed_in(site.approver_a).get(url).content.decode()
    assert 'data-decision="approve"' in approver and 'data-decision="reject"' in approver
    assert "ship it" in approver and "not measured yet" in approver
    # No traffic yet: the evidence says so instead of a diff of zeros.
    assert "not enough data: n = 0 (candidate), 0 (baseline)" in approver
    assert "candidate − baseline" not in approver
    requester = signed_in(site.engineer_a).get(url).content.decode()
    assert 'data-decision="approve"' not in requester and "data-own-request" in requester


def test_an_approver_cannot_decide_their_own_request(site, onnx_bytes):
    plan = make_plan(site.a, "other", onnx_bytes)
    own = approvals.request_promotion(
        plan.model, None, actor(site.approver_a, "approver"), plan=plan
    )
    content = signed_in(site.approver_a).get(f"/approvals/{own.pk}/").content.decode()
    assert 'data-decision="approve"' not in content and "data-own-request" in content


def test_a_decided_request_shows_the_decision_and_frozen_evidence(site):
    approvals.approve(site.req_a, actor(site.approver_a, "approver"), "numbers look fine")
    response = signed_in(site.viewer_a).get(f"/approvals/{site.req_a.pk}/")
    content = response.content.decode()
    assert "numbers look fine" in content and "frozen at the decision" in content
    assert 'data-decision="approve"' not in content
    assert [r.pk for r in signed_in(site.viewer_a).get("/approvals/").context["decided"]] == [
        site.req_a.pk
    ]


def test_audit_log_filters_and_pages_the_tenants_events(site):
    for n in range(6, 60):  # 54 weight changes within the policy's 10 %, each audited
        actions.set_weight(site.plan_a, n % 10 + 1, actor(site.engineer_a, "engineer"))
    client = signed_in(site.engineer_a)
    first = client.get("/audit/")
    assert (
        first.context["page_obj"].paginator.count
        == AuditEvent.objects.filter(tenant=site.a).count()
    )
    assert len(first.context["rows"]) == 50 and b"secret-b" not in first.content
    assert "weight: 9.0 → <b>10</b>" in first.content.decode()  # before → after
    assert client.get("/audit/?page=2").context["page_obj"].number == 2
    started = client.get("/audit/?action=plan.start").context["rows"]
    assert [e.action for e, _, _ in started] == ["plan.start"]
    assert client.get("/audit/?actor=nobody").context["page_obj"].paginator.count == 0
    assert client.get("/audit/?q=clf").context["page_obj"].paginator.count > 50


def test_tenant_switcher_keeps_the_choice_in_the_session(site):
    Membership.objects.create(tenant=site.b, user=site.engineer_a, role="viewer")
    client = signed_in(site.engineer_a)
    assert [m["name"] for m in client.get("/").context["snapshot"]["models"]] == ["clf"]
    client.post("/tenant/", {"tenant": "beta", "next": "/audit/"})
    assert client.session[SESSION_KEY] == site.b.pk
    response = client.get("/")
    assert [m["name"] for m in response.context["snapshot"]["models"]] == ["secret-b"]
    assert response.context["membership"].role == "viewer"
    assert client.get(f"/rollouts/{site.plan_a.pk}/").status_code == 404


def test_switching_to_a_tenant_one_is_not_a_member_of_is_ignored(site):
    client = signed_in(site.engineer_a)
    assert client.post("/tenant/", {"tenant": "beta"})["Location"] == "/"
    assert SESSION_KEY not in client.session


def test_a_user_without_membership_sees_no_tenant_data(site):
    response = signed_in(site.outsider).get("/")
    assert response.status_code == 403 and b"not a member of any tenant" in response.content


def test_a_superuser_in_no_tenant_looks_at_any_read_only(site, django_user_model):
    admin = django_user_model.objects.create_superuser("root", password="pw-root-1")
    client = signed_in(admin)
    response = client.get("/")
    assert [m["name"] for m in response.context["snapshot"]["models"]] == ["clf"]
    assert response.context["membership"].role == "viewer" and not response.context["can_write"]
    client.post("/tenant/", {"tenant": "beta"})
    assert b"secret-b" in client.get("/").content
    assert 'data-action="kill"' not in client.get(f"/rollouts/{site.plan_b.pk}/").content.decode()


def test_plotly_is_served_from_the_installed_package():
    assert finders.find("vendor/plotly.min.js") and finders.find("ui/app.js")


# The live socket -----------------------------------------------------------------------------


def live(user, session: dict | None = None) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(LiveConsumer.as_asgi(), "/ws/ui/live/")
    communicator.scope["user"] = user
    communicator.scope["session"] = session or {}
    return communicator


def exchange(user, message: dict, session: dict | None = None) -> tuple[bool, dict]:
    """Connect, subscribe and return (accepted, the first answer: a message or the close)."""

    async def run():
        communicator = live(user, session)
        connected, _ = await communicator.connect()
        if not connected:
            return False, {}
        await communicator.send_json_to(message)
        answer = await communicator.receive_output(timeout=10)
        await communicator.disconnect()
        return True, answer

    return async_to_sync(run)()


def test_live_dashboard_snapshot_is_the_tenants(site):
    accepted, answer = exchange(site.viewer_a, {"subscribe": "dashboard"})
    assert accepted and answer["type"] == "websocket.send"
    assert '"type": "dashboard"' in answer["text"] and "secret-b" not in answer["text"]


def test_live_plan_snapshot_has_arms_and_series(site):
    _, answer = exchange(site.viewer_a, {"subscribe": "plan", "id": site.plan_a.pk})
    update = json.loads(answer["text"])
    assert update["type"] == "plan" and update["weight"] == 5 and update["state"] == "running"
    assert [a["arm"] for a in update["arms"]] == ["baseline", "candidate"]
    assert set(update["series"]) == {"baseline", "candidate"}
    assert [(r["kind"], r["state"]) for r in update["requests"]] == [("promotion", "pending")]


def test_live_plan_of_another_tenant_closes_with_4404(site):
    _, answer = exchange(site.viewer_a, {"subscribe": "plan", "id": site.plan_b.pk})
    assert answer == {"type": "websocket.close", "code": 4404}


def test_live_socket_refuses_anonymous_users(db):
    accepted, _ = exchange(AnonymousUser(), {"subscribe": "dashboard"})
    assert not accepted


@pytest.mark.parametrize(
    "text", ["{not json", '{"subscribe": "everything"}', '{"subscribe": "plan", "id": "1"}']
)
def test_live_socket_closes_4400_on_a_bad_message(site, text):
    async def run():
        communicator = live(site.viewer_a)
        await communicator.connect()
        await communicator.send_to(text_data=text)
        answer = await communicator.receive_output(timeout=10)
        await communicator.disconnect()
        return answer

    assert async_to_sync(run)() == {"type": "websocket.close", "code": 4400}


def test_audit_rows_link_to_their_objects_and_filter_by_date(site):
    client = signed_in(site.engineer_a)
    response = client.get("/audit/")
    rows = response.context["rows"]
    links = {e.action: link for e, _, link in rows}
    assert links["plan.start"] == "/models/clf/aliases/production/"
    assert links["approval.request"] == f"/approvals/{site.req_a.pk}/"
    assert links["version.create"] == "/models/clf/"
    assert b'href="/models/clf/aliases/production/"' in response.content
    assert b"<code>plan.<wbr>start</code>" in response.content  # wraps at the dot only
    today = timezone.now().date()
    kept = client.get(f"/audit/?from={today}&to={today}").context["page_obj"].paginator.count
    assert kept == AuditEvent.objects.filter(tenant=site.a).count()
    later = today + timedelta(days=1)
    assert client.get(f"/audit/?from={later}").context["page_obj"].paginator.count == 0
    earlier = today - timedelta(days=1)
    assert client.get(f"/audit/?to={earlier}").context["page_obj"].paginator.count == 0
    bad = client.get("/audit/?from=2026-02-30&to=yesterday")
    assert bad.status_code == 400
    assert bad.context["errors"] == {"from": "a date, YYYY-MM-DD", "to": "a date, YYYY-MM-DD"}
