"""Alerts: one open alert per condition (raised, refreshed, resolved), delivery to the tenant's
webhook as Slack JSON against a real HTTP server (retried, then marked failed), and the alerts
API: tenant-scoped reads, resolving (engineers and approvers, audited), the webhook setting."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rest_framework.test import APIClient

from monitoring import tasks
from monitoring.alerts import open_alerts, raise_alert, resolve_alert
from monitoring.models import Alert
from tenants.models import AuditEvent
from tests.factories import make_member, make_model

pytestmark = pytest.mark.backends


class Receiver:
    """A webhook receiver on 127.0.0.1: records every POST and answers the next status of
    ``statuses`` (the last one repeats)."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.bodies: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                length = int(self.headers["Content-Length"])
                receiver.bodies.append(
                    {
                        "path": self.path,
                        "content_type": self.headers["Content-Type"],
                        "json": json.loads(self.rfile.read(length)),
                    }
                )
                status = (
                    receiver.statuses.pop(0) if len(receiver.statuses) > 1 else receiver.statuses[0]
                )
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/T000/B000/secret"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def local_webhooks(settings):
    """The receivers below listen on 127.0.0.1, which production refuses (see the test)."""
    settings.SWITCHYARD_WEBHOOK_ALLOW_PRIVATE = True


def test_a_webhook_on_a_private_network_is_not_called(world, settings):
    settings.SWITCHYARD_WEBHOOK_ALLOW_PRIVATE = False
    with Receiver([200]) as receiver:
        world.a.alert_webhook_url = receiver.url
        world.a.save()
        alert, _ = drift_alert(world.a)
        tasks.deliver_alert.apply(args=[alert.pk])
        alert.refresh_from_db()
        assert receiver.bodies == []
    assert alert.webhook_state == "failed" and "private network" in alert.webhook_error


def drift_alert(tenant, key: str = "drift:1:age", **fields) -> tuple[Alert, bool]:
    return raise_alert(
        tenant.pk,
        "drift",
        key,
        fields.pop("title", "clf v1: age drifted"),
        fields.pop("message", "PSI 0.41 over 0.2"),
        **fields,
    )


# Raise, refresh, resolve ---------------------------------------------------------------------


def test_raising_an_open_condition_again_refreshes_it_instead_of_opening_another(world):
    first, new = drift_alert(world.a, details={"psi": 0.41})
    assert new and first.resolved_at is None and first.webhook_state == "none"
    again, new = drift_alert(world.a, message="PSI 0.52 over 0.2", details={"psi": 0.52})
    assert not new and again.pk == first.pk
    again.refresh_from_db()
    assert again.message == "PSI 0.52 over 0.2" and again.details == {"psi": 0.52}
    assert again.last_seen_at > first.last_seen_at
    assert list(open_alerts(world.a.pk)) == [again]


def test_the_same_key_in_another_tenant_is_another_alert(world):
    a, _ = drift_alert(world.a)
    b, new = drift_alert(world.b)
    assert new and a.pk != b.pk
    assert list(open_alerts(world.b.pk)) == [b]


def test_resolving_closes_it_and_a_later_raise_opens_a_new_one(world):
    first, _ = drift_alert(world.a)
    assert resolve_alert(world.a.pk, first.key) == 1
    assert resolve_alert(world.a.pk, first.key) == 0  # nothing open any more
    first.refresh_from_db()
    assert first.resolved_at is not None
    second, new = drift_alert(world.a)
    assert new and second.pk != first.pk
    assert list(open_alerts(world.a.pk)) == [second]


# Webhook delivery ----------------------------------------------------------------------------


def run_deliveries_now(monkeypatch):
    """The worker, in process: queueing ``deliver_alert`` (by name) runs the task eagerly (its
    retries too, without the countdown)."""
    monkeypatch.setattr(
        tasks.deliver_alert,
        "apply_async",
        lambda args, kwargs=None, **options: tasks.deliver_alert.apply(args=args),
    )


def test_a_new_alert_is_posted_to_the_webhook_as_slack_json_after_the_commit(
    world, monkeypatch, django_capture_on_commit_callbacks
):
    run_deliveries_now(monkeypatch)
    with Receiver([200]) as hook:
        world.a.alert_webhook_url = hook.url
        world.a.save()
        model = make_model(world.a, "clf")
        with django_capture_on_commit_callbacks(execute=True):
            alert, _ = drift_alert(world.a, model_id=model.pk, severity="critical")
            assert hook.bodies == []  # nothing leaves before the commit
        # Refreshing the open alert posts nothing more.
        with django_capture_on_commit_callbacks(execute=True):
            drift_alert(world.a)
    assert len(hook.bodies) == 1
    posted = hook.bodies[0]
    assert posted["path"] == "/hooks/T000/B000/secret"
    assert posted["content_type"] == "application/json"
    assert posted["json"] == {
        "text": ":rotating_light: [alpha] clf v1: age drifted",
        "blocks": [
            {
                "type": "section",
                "text": {
                    "type": "mrkdwn",
                    "text": "*:rotating_light: [alpha] clf v1: age drifted*\nPSI 0.41 over 0.2",
                },
            }
        ],
    }
    alert.refresh_from_db()
    assert (alert.webhook_state, alert.webhook_attempts, alert.webhook_error) == ("sent", 1, "")


def test_a_failing_webhook_is_retried_until_it_answers(world, monkeypatch):
    with Receiver([500, 503, 200]) as hook:
        world.a.alert_webhook_url = hook.url
        world.a.save()
        alert, _ = drift_alert(world.a)
        assert alert.webhook_state == "pending"
        tasks.deliver_alert.apply(args=[alert.pk])
    assert len(hook.bodies) == 3
    alert.refresh_from_db()
    assert (alert.webhook_state, alert.webhook_attempts, alert.webhook_error) == ("sent", 3, "")


def test_a_webhook_that_keeps_failing_is_marked_failed_after_the_last_retry(world):
    with Receiver([500]) as hook:
        world.a.alert_webhook_url = hook.url
        world.a.save()
        alert, _ = drift_alert(world.a)
        tasks.deliver_alert.apply(args=[alert.pk])
    tries = 1 + tasks.deliver_alert.max_retries
    assert len(hook.bodies) == tries
    alert.refresh_from_db()
    assert alert.webhook_state == "failed" and alert.webhook_attempts == tries
    assert alert.webhook_error == "webhook answered 500"
    assert alert.resolved_at is None  # still shown in the UI


def test_an_unreachable_webhook_fails_too(world):
    with Receiver([200]) as hook:
        url = hook.url  # the port is closed once the receiver stops
    world.a.alert_webhook_url = url
    world.a.save()
    alert, _ = drift_alert(world.a)
    tasks.deliver_alert.apply(args=[alert.pk])
    alert.refresh_from_db()
    assert alert.webhook_state == "failed" and alert.webhook_error


# The API -------------------------------------------------------------------------------------


def key_client(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def member_client(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


@pytest.fixture
def alerts(world):
    """Tenant A: an open drift alert on ``clf``, a resolved rollback alert, an open SLO alert;
    tenant B: an open drift alert."""
    clf = make_model(world.a, "clf")
    world.drift, _ = drift_alert(world.a, model_id=clf.pk)
    world.rollback, _ = raise_alert(
        world.a.pk, "rollback", "rollback:7", "clf: rollout #7 rolled back", "p99 too high"
    )
    resolve_alert(world.a.pk, "rollback:7")
    world.slo, _ = raise_alert(
        world.a.pk, "slo_burn", "slo:1:availability", "clf: burning", "14.4x", severity="critical"
    )
    world.b_alert, _ = drift_alert(world.b, title="secret-b drifted")
    world.api_a = key_client(world.key_a)
    world.api_b = key_client(world.key_b)
    return world


def ids(response) -> list[int]:
    assert response.status_code == 200, response.json()
    return [a["id"] for a in response.json()]


def test_the_list_shows_open_alerts_by_default_and_filters_by_state_and_kind(alerts):
    api = alerts.api_a
    assert ids(api.get("/api/v1/alerts")) == [alerts.slo.pk, alerts.drift.pk]
    assert ids(api.get("/api/v1/alerts?state=resolved")) == [alerts.rollback.pk]
    assert ids(api.get("/api/v1/alerts?state=all")) == [
        alerts.slo.pk,
        alerts.rollback.pk,
        alerts.drift.pk,
    ]
    assert ids(api.get("/api/v1/alerts?state=all&kind=rollback")) == [alerts.rollback.pk]
    assert ids(api.get("/api/v1/alerts?kind=drift&model=clf")) == [alerts.drift.pk]
    first = api.get("/api/v1/alerts").json()[1]
    assert first["state"] == "open" and first["model"] == "clf" and first["kind"] == "drift"
    assert {"title", "message", "severity", "webhook_state", "last_seen_at"} <= set(first)


def test_bad_filters_are_400_naming_the_parameter(alerts):
    bad_state = alerts.api_a.get("/api/v1/alerts?state=closed")
    assert bad_state.status_code == 400 and bad_state.json()["error"].startswith("state:")
    bad_kind = alerts.api_a.get("/api/v1/alerts?kind=fire")
    assert bad_kind.status_code == 400 and bad_kind.json()["error"].startswith("kind:")


def test_one_alert_reads_in_full(alerts):
    body = alerts.api_a.get(f"/api/v1/alerts/{alerts.slo.pk}").json()
    assert (body["id"], body["severity"], body["key"]) == (
        alerts.slo.pk,
        "critical",
        "slo:1:availability",
    )
    assert body["model"] is None and body["resolved_at"] is None


def test_another_tenants_alerts_are_404_and_never_listed(alerts):
    api = alerts.api_b
    assert ids(api.get("/api/v1/alerts?state=all")) == [alerts.b_alert.pk]
    assert api.get(f"/api/v1/alerts/{alerts.drift.pk}").status_code == 404
    resolve = api.post(f"/api/v1/alerts/{alerts.drift.pk}/resolve", {}, format="json")
    assert resolve.status_code == 404
    alerts.drift.refresh_from_db()
    assert alerts.drift.resolved_at is None


def test_an_engineer_resolves_an_alert_and_it_is_audited(alerts):
    api = member_client(alerts.engineer_a)
    response = api.post(
        f"/api/v1/alerts/{alerts.drift.pk}/resolve", {"reason": "new reference"}, format="json"
    )
    assert response.status_code == 200, response.json()
    assert response.json()["state"] == "resolved" and response.json()["resolved_at"]
    event = AuditEvent.objects.get(action="alert.resolve")
    assert (event.tenant_id, event.actor_label, event.reason) == (
        alerts.a.pk,
        "eng-a",
        "new reference",
    )
    assert event.target == f"alert #{alerts.drift.pk} drift:1:age"
    assert (event.before, event.after) == ({"state": "open"}, {"state": "resolved"})


def test_an_approver_may_resolve_too_and_a_second_resolve_is_409(alerts):
    approver = member_client(make_member(alerts.a, "appr-a", "approver"))
    url = f"/api/v1/alerts/{alerts.slo.pk}/resolve"
    assert approver.post(url, {}, format="json").status_code == 200
    again = approver.post(url, {}, format="json")
    assert again.status_code == 409 and "already resolved" in again.json()["error"]
    assert AuditEvent.objects.filter(action="alert.resolve").count() == 1


def test_a_viewer_reads_alerts_but_cannot_resolve_them(alerts):
    viewer = member_client(alerts.viewer_a)
    assert ids(viewer.get("/api/v1/alerts")) == [alerts.slo.pk, alerts.drift.pk]
    response = viewer.post(f"/api/v1/alerts/{alerts.drift.pk}/resolve", {}, format="json")
    assert response.status_code == 403
    alerts.drift.refresh_from_db()
    assert alerts.drift.resolved_at is None


def test_an_outsider_gets_nothing(alerts):
    outsider = member_client(alerts.outsider)
    assert outsider.get("/api/v1/alerts").status_code == 403
    assert outsider.get(f"/api/v1/alerts/{alerts.drift.pk}").status_code == 403


def test_the_webhook_url_is_set_read_and_audited_without_its_secret(alerts):
    api = member_client(alerts.engineer_a)
    assert api.get("/api/v1/alert-settings").json() == {"webhook_url": ""}
    url = "https://hooks.slack.com/services/T000/B000/XXXXSECRET"
    response = api.put("/api/v1/alert-settings", {"webhook_url": url}, format="json")
    assert response.status_code == 200 and response.json() == {"webhook_url": url}
    alerts.a.refresh_from_db()
    assert alerts.a.alert_webhook_url == url
    assert alerts.api_a.get("/api/v1/alert-settings").json() == {"webhook_url": url}
    event = AuditEvent.objects.get(action="alert.webhook")
    assert event.after == {"webhook_url": "https://hooks.slack.com/…"}
    assert "SECRET" not in json.dumps([event.before, event.after, event.target])
    cleared = api.put("/api/v1/alert-settings", {"webhook_url": ""}, format="json")
    assert cleared.status_code == 200
    alerts.a.refresh_from_db()
    assert alerts.a.alert_webhook_url == ""


@pytest.mark.parametrize(
    "body", [{"webhook_url": "not a url"}, {"webhook_url": "ftp://example.com/x"}, {}]
)
def test_a_bad_webhook_url_is_400_naming_the_field(alerts, body):
    response = alerts.api_a.put("/api/v1/alert-settings", body, format="json")
    assert response.status_code == 400
    assert response.json()["error"].startswith("webhook_url:")
    alerts.a.refresh_from_db()
    assert alerts.a.alert_webhook_url == ""


def test_viewers_neither_read_nor_set_the_webhook(alerts):
    viewer = member_client(alerts.viewer_a)
    assert viewer.get("/api/v1/alert-settings").status_code == 403
    put = viewer.put(
        "/api/v1/alert-settings", {"webhook_url": "https://x.example/h"}, format="json"
    )
    assert put.status_code == 403


def test_each_tenant_sets_only_its_own_webhook(alerts):
    response = alerts.api_b.put(
        "/api/v1/alert-settings", {"webhook_url": "https://b.example/hook"}, format="json"
    )
    assert response.status_code == 200
    alerts.a.refresh_from_db()
    alerts.b.refresh_from_db()
    assert (alerts.a.alert_webhook_url, alerts.b.alert_webhook_url) == (
        "",
        "https://b.example/hook",
    )
    assert alerts.api_a.get("/api/v1/alert-settings").json() == {"webhook_url": ""}


def test_the_alert_endpoints_are_in_the_openapi_schema(alerts):
    schema = alerts.api_a.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    for path in (
        "/api/v1/alerts",
        "/api/v1/alerts/{alert_id}",
        "/api/v1/alerts/{alert_id}/resolve",
        "/api/v1/alert-settings",
    ):
        assert path in schema["paths"], path
