"""The web UI's self-service and governance pages (issue 17, the UI): an engineer creates a model,
uploads a version and sets a drift reference without the admin; viewers see no forms and are
refused; another tenant's model is a 404; the rollout page's step timeline; times labelled UTC;
the online quality chart with zero, one and many time buckets."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client
from django.utils import timezone

from registry.models import Model, ReferenceSample
from rollouts import actions, approvals
from rollouts.models import PlanState, RolloutPolicy
from tenants.audit import Actor
from tenants.models import AuditEvent
from tests.factories import make_member, make_model, make_version
from tests.onnx_models import small_onnx
from tests.test_feedback import label, make_log
from web.prediction_views import quality_chart
from web.snapshots import plan_snapshot, plan_timeline

pytestmark = pytest.mark.backends

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}


def signed_in(user, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def embedded(content: bytes, script_id: str) -> dict:
    found = re.search(
        rb'<script id="%s" type="application/json">(.*?)</script>' % script_id.encode(), content
    )
    assert found, f"no {script_id} JSON on the page"
    return json.loads(found.group(1))


# New model ---------------------------------------------------------------------------------------


def test_an_engineer_creates_a_model_from_the_home_page_and_it_is_audited(world):
    client = signed_in(world.engineer_a)
    home = client.get("/")
    assert b'id="new-model"' in home.content and b'action="/models/"' in home.content

    response = client.post(
        "/models/", {"name": "churn", "task": "classifier", "description": "who leaves"}
    )
    assert response.status_code == 302 and response["Location"] == "/models/churn/"
    model = Model.objects.get(tenant=world.a, name="churn")
    assert (model.task, model.description) == ("classifier", "who leaves")
    event = AuditEvent.objects.get(tenant=world.a, action="model.create")
    assert (event.actor_id, event.target) == (world.engineer_a.pk, "churn")
    assert event.after["task"] == "classifier"
    assert client.get("/models/churn/").status_code == 200


def test_a_bad_or_taken_model_name_is_shown_inline_with_a_400(world):
    client = signed_in(world.engineer_a)
    make_model(world.a, "taken")
    bad = client.post("/models/", {"name": "no spaces allowed!", "task": "classifier"})
    assert bad.status_code == 400
    assert b'class="field-error"' in bad.content and b"no spaces allowed!" in bad.content
    taken = client.post("/models/", {"name": "taken", "task": "classifier"})
    assert taken.status_code == 400 and b"already has a model with this name" in taken.content
    task = client.post("/models/", {"name": "fine", "task": "astrology"})
    assert task.status_code == 400 and b"astrology" in task.content
    assert not Model.objects.filter(name__in=["fine", "no spaces allowed!"]).exists()
    assert not AuditEvent.objects.filter(action="model.create").exists()


def test_another_tenants_model_name_is_free_and_not_revealed(world, onnx_bytes):
    make_version(make_model(world.b, "secret-b"), onnx_bytes)
    client = signed_in(world.engineer_a)
    response = client.post("/models/", {"name": "secret-b", "task": "regressor"})
    assert response.status_code == 302  # a name is unique within a tenant only
    assert Model.objects.get(tenant=world.a, name="secret-b").task == "regressor"
    assert Model.objects.get(tenant=world.b, name="secret-b").task == "classifier"


# Upload a version (the page's script posts to the REST endpoint with the session) -----------------


def test_an_engineer_uploads_a_version_with_the_session_and_csrf_token(world, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    client = signed_in(world.engineer_a, csrf=True)
    page = client.get("/models/clf/")
    assert b'id="upload-form"' in page.content and b"<progress" in page.content
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page.content).group(1)
    headers = {"X-CSRFToken": token.decode(), "X-Tenant": world.a.slug}
    artifact = ("v2.onnx", small_onnx(seed=3), "application/octet-stream")

    def upload(**extra):
        from django.core.files.uploadedfile import SimpleUploadedFile

        body = {"artifact": SimpleUploadedFile(*artifact), "description": "retrained", **extra}
        return client.post("/api/v1/models/clf/versions", body, headers=headers)

    created = upload()
    assert created.status_code == 201, created.content
    assert created.json()["version"] == 2 and created.json()["description"] == "retrained"
    shown = client.get("/models/clf/?uploaded=2")
    assert b'data-version="2"' in shown.content and b"data-uploaded" in shown.content

    refused = upload(format="pickle")  # a 4xx whose message the page shows
    assert refused.status_code == 400 and "format" in refused.json()["error"]
    no_token = client.post(
        "/api/v1/models/clf/versions",
        {"description": "x"},
        headers={"X-Tenant": world.a.slug},
    )
    assert no_token.status_code == 403  # the session alone is not enough: CSRF is checked


# Drift reference ---------------------------------------------------------------------------------


@pytest.fixture
def logged_clf(world, onnx_bytes):
    """Tenant A's ``clf`` v1 with 40 logged predictions over the last 2 hours."""
    model = make_model(world.a, "clf")
    version = make_version(model, onnx_bytes)
    now = timezone.now()
    for i in range(40):
        make_log(version, f"r{i}", [i / 40], at=now - timedelta(minutes=3 * i + 1))
    return version


def test_an_engineer_sets_the_drift_reference_from_the_last_hours(world, logged_clf):
    client = signed_in(world.engineer_a)
    drift = client.get("/models/clf/drift/")
    assert b'id="reference-form"' in drift.content
    response = client.post(
        "/models/clf/drift/reference/", {"version": "1", "mode": "hours", "hours": "3"}
    )
    assert response.status_code == 302
    assert response["Location"] == "/models/clf/drift/?version=1&reference=40"
    sample = ReferenceSample.objects.get(version=logged_clf)
    assert (sample.source, sample.rows) == ("window", 40)
    event = AuditEvent.objects.filter(tenant=world.a, actor_id=world.engineer_a.pk).latest("pk")
    assert "reference" in event.action
    assert b"data-reference-set" in client.get(response["Location"]).content


def test_a_drift_reference_window_in_utc_and_its_errors_inline(world, logged_clf):
    client = signed_in(world.engineer_a)
    now = datetime.now(UTC)
    start = (now - timedelta(minutes=61)).strftime("%Y-%m-%dT%H:%M")
    end = now.strftime("%Y-%m-%dT%H:%M:%S")
    window = {"version": "1", "mode": "window", "window_start": start, "window_end": end}
    ok = client.post("/models/clf/drift/reference/", window)
    # The first 20 logs lie in the last hour: fewer than the 30 a reference needs.
    assert ok.status_code == 400 and b"at least 30" in ok.content
    window["window_start"] = (now - timedelta(hours=3)).strftime("%Y-%m-%dT%H:%M")
    assert client.post("/models/clf/drift/reference/", window).status_code == 302

    cases = [
        ({"mode": "hours", "hours": "soon"}, b"a number of hours"),
        ({"mode": "hours", "hours": "-2"}, b"between 0 and"),
        ({"mode": "window", "window_start": "yesterday", "window_end": end}, b"(UTC)"),
        ({"mode": "window", "window_start": end, "window_end": start}, b"must be after"),
        ({"mode": "hours", "hours": "2", "version": "99999999999999999999"}, b"choose a version"),
        ({"mode": "hours", "hours": "2", "version": "²"}, b"choose a version"),  # isdigit()
    ]
    for body, message in cases:
        response = client.post("/models/clf/drift/reference/", {"version": "1", **body})
        assert response.status_code == 400 and message in response.content, body


@pytest.mark.parametrize("version", ["²", "99999999999999999999", "-1", "v1"])
def test_the_drift_page_falls_back_on_a_version_it_cannot_read(world, logged_clf, version):
    page = signed_in(world.engineer_a).get("/models/clf/drift/", {"version": version})
    assert page.status_code == 200 and page.context["snapshot"]["version"] == 1


def test_another_tenants_model_is_a_404_for_every_form(world, onnx_bytes):
    make_version(make_model(world.b, "secret-b"), onnx_bytes)
    client = signed_in(world.engineer_a)
    body = {"version": "1", "mode": "hours", "hours": "1"}
    assert client.post("/models/secret-b/drift/reference/", body).status_code == 404
    assert client.get("/models/secret-b/").status_code == 404
    assert client.post("/api/v1/models/secret-b/versions", {}).status_code == 404
    assert not ReferenceSample.objects.exists()


def test_viewers_see_no_forms_and_their_posts_are_refused(world, logged_clf):
    client = signed_in(world.viewer_a)
    assert b'id="new-model"' not in client.get("/").content
    assert b'id="upload-form"' not in client.get("/models/clf/").content
    assert b'id="reference-form"' not in client.get("/models/clf/drift/").content
    assert client.post("/models/", {"name": "sneaky", "task": "classifier"}).status_code == 403
    body = {"version": "1", "mode": "hours", "hours": "3"}
    assert client.post("/models/clf/drift/reference/", body).status_code == 403
    upload = client.post(
        "/api/v1/models/clf/versions", {"artifact": b""}, headers={"X-Tenant": world.a.slug}
    )
    assert upload.status_code == 403
    assert not Model.objects.filter(name="sneaky").exists()
    assert not ReferenceSample.objects.exists()
    assert Client().post("/models/", {"name": "anon"}).status_code == 302  # to sign in


def test_an_approver_may_use_the_forms_too(world):
    approver = make_member(world.a, "approver-a", "approver")
    response = signed_in(approver).post("/models/", {"name": "by-approver", "task": "regressor"})
    assert response.status_code == 302


# Rollout timeline ----------------------------------------------------------------------------


def canary(world, onnx_bytes, **options):
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes)
    candidate = make_version(model, small_onnx(seed=3), alias=None)
    return actions.start_plan(
        model, "canary", candidate, GUARDRAILS, Actor(None, "test"), weight=5, **options
    )


def states(timeline: dict) -> list[tuple[float, str]]:
    return [(s["weight"], s["state"]) for s in timeline["steps"]]


def test_the_timeline_shows_done_current_upcoming_and_the_bake_end(world, onnx_bytes):
    plan = canary(world, onnx_bytes, steps=[1, 5, 25, 50, 100], bake_seconds=300, max_weight=50)
    timeline = plan_snapshot(plan)["timeline"]
    assert states(timeline) == [
        (1, "skipped"),  # the plan started at 5 %: it never ran at 1 %
        (5, "current"),
        (25, "upcoming"),
        (50, "upcoming"),
        (100, "upcoming"),
    ]
    # Above the plan's max_weight (capped by the rollout policy's 10 % default) a step needs
    # an approval, and so does 100 % (a promotion).
    assert [s["gated"] for s in timeline["steps"]] == [False, False, True, True, True]
    assert timeline["end"] == "upcoming"
    ends = datetime.fromisoformat(timeline["bake_ends_at"])
    assert ends == plan.step_started_at + timedelta(seconds=300)
    assert datetime.fromisoformat(timeline["now"]) <= ends


def test_open_requests_show_as_needing_approval(world, onnx_bytes):
    plan = canary(world, onnx_bytes, steps=[5, 25, 100], max_weight=25)
    engineer = Actor(world.engineer_a.pk, "eng-a", "engineer")
    approvals.change_weight(plan, 60, engineer, "looks fine")  # above 25: a request
    approvals.request_promotion(plan.model, None, engineer, comment="ship", plan=plan)
    plan.refresh_from_db()
    timeline = plan_timeline(plan, list(plan.requests.all()))
    assert states(timeline) == [
        (5, "current"),
        (25, "upcoming"),
        (60, "approval"),
        (100, "upcoming"),
    ]
    assert timeline["end"] == "approval"


def test_the_timeline_shows_steps_as_they_happened(world, onnx_bytes):
    """Measured: skipped steps drawn as done, and after a kill every step "not reached",
    including those that ran."""
    RolloutPolicy.objects.create(tenant=world.a, max_weight_without_approval=100)
    plan = canary(world, onnx_bytes, steps=[5, 25, 50, 100], max_weight=100)
    plan = actions.set_weight(plan, 50, Actor(None, "test"), "jump")  # 25 never ran
    assert states(plan_timeline(plan, [])) == [
        (5, "done"),
        (25, "skipped"),
        (50, "current"),
        (100, "upcoming"),
    ]
    ended = actions.kill(plan, Actor(None, "test"), "bad")
    timeline = plan_timeline(ended, [])
    assert ended.state == PlanState.ROLLED_BACK and timeline["end"] == "rolled_back"
    assert states(timeline) == [
        (5, "done"),
        (25, "not_reached"),
        (50, "killed"),
        (100, "not_reached"),
    ]
    assert timeline["bake_ends_at"] is None
    ended.state = PlanState.PROMOTED
    promoted = plan_timeline(ended, [])
    assert promoted["end"] == "promoted"
    assert states(promoted) == [(5, "done"), (25, "skipped"), (50, "done"), (100, "skipped")]


def test_the_rollout_page_has_the_timeline_and_an_apply_button(world, onnx_bytes):
    plan = canary(world, onnx_bytes)
    content = signed_in(world.engineer_a).get(f"/rollouts/{plan.pk}/").content
    assert b"data-timeline" in content and b"data-countdown" in content
    assert b'id="apply-weight"' in content and b"Apply weight" in content
    assert embedded(content, "snapshot")["timeline"]["steps"]
    viewer = signed_in(world.viewer_a).get(f"/rollouts/{plan.pk}/").content
    assert b'id="apply-weight"' not in viewer and b"data-timeline" in viewer


# Times are UTC, labelled --------------------------------------------------------------------------


def test_server_rendered_times_are_labelled_utc(world, onnx_bytes):
    plan = canary(world, onnx_bytes)
    client = signed_in(world.engineer_a)
    stamp = plan.step_started_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert stamp.encode() in client.get(f"/rollouts/{plan.pk}/").content
    event = AuditEvent.objects.filter(tenant=world.a).latest("pk")
    audit = client.get("/audit/").content
    assert event.created_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC").encode() in audit
    assert b'class="table-scroll"' in audit  # a wide table scrolls in its own box


# The online quality chart with zero, one and many buckets -----------------------------------------


def point(start: datetime, accuracy: float | None) -> dict:
    return {
        "bucket_start": start,
        "version": 1,
        "arm": "",
        "logged": 3,
        "labelled": 1,
        "labelled_rows": 1,
        "accuracy": accuracy,
        "auc": None,
    }


@pytest.mark.parametrize("buckets", [0, 1, 5])
def test_the_quality_chart_spans_its_window_whatever_the_number_of_buckets(buckets):
    until = datetime(2026, 11, 26, 14, 30, tzinfo=UTC)
    since = until - timedelta(hours=48)
    series = [point(until - timedelta(hours=h + 1), 0.9) for h in range(buckets)][::-1]
    chart = quality_chart("classifier", series, (since, until))
    # An explicit range: one point alone gets a readable time axis, not a millisecond's.
    assert chart["range"] == [since.isoformat(), until.isoformat()]
    assert len(chart["lines"]) == (1 if buckets else 0)
    if buckets:
        assert len(chart["lines"][0]["t"]) == buckets == len(chart["lines"][0]["accuracy"])


def test_the_predictions_page_with_one_bucket_embeds_the_window(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    make_log(version, "only", [0.8], at=timezone.now() - timedelta(minutes=1))
    label(world.a, "only", 1)
    content = signed_in(world.engineer_a).get("/models/clf/predictions/").content
    chart = embedded(content, "quality")
    assert len(chart["lines"]) == 1 and chart["lines"][0]["accuracy"] == [1.0]
    start, end = (datetime.fromisoformat(t) for t in chart["range"])
    assert end - start == timedelta(hours=48)
