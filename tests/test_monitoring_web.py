"""The drift, SLO and alerts pages: a member sees the tenant's models (drift from real reports
of ``monitoring.drift``, traffic per version and arm, SLIs with budgets and burn), the JSON the
pages poll has the shape their scripts read, empty states say what to do, and another tenant's
model is a 404 while its alerts and SLOs never show."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from monitoring import drift
from monitoring.alerts import raise_alert, resolve_alert
from monitoring.models import TrafficSample
from monitoring.traffic import Counts
from registry.models import ReferenceSample
from rollouts import actions
from rollouts.models import RolloutPolicy
from tenants.audit import Actor
from tests.factories import make_log, make_member, make_model, make_tenant, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends

RAILS = {"max_error_rate_increase": 0.01, "max_p99_ratio": 2.0, "min_samples": 100}
COUNTRIES = ["de", "fr", "us"]


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def columns(rng, n: int, age_mean: float, country_p) -> dict:
    return {
        "age": rng.normal(age_mean, 10, n).round(2).tolist(),
        "country": rng.choice(COUNTRIES, n, p=country_p).tolist(),
    }


def traffic(version, at, ok: int, errors: int, seconds: float) -> None:
    counts = Counts()
    for _ in range(ok):
        counts.add(seconds, ok=True)
    for _ in range(errors):
        counts.add(seconds, ok=False)
    TrafficSample.objects.create(
        version=version,
        window_end=at,
        requests=counts.requests,
        errors=counts.errors,
        latency_buckets=counts.buckets,
    )


@pytest.fixture
def site(world, onnx_bytes, rng):
    """A's ``clf``: v1 in production with a reference (age ~ N(40, 10)) and logged predictions
    whose age moved to N(55, 10), two drift reports; v2 a canary candidate; traffic on both.
    B's ``secret-b`` with an open alert."""
    model = make_model(world.a, "clf")
    v1 = make_version(model, onnx_bytes)
    v2 = make_version(model, small_onnx(seed=3), alias=None)
    ref = columns(rng, 400, 40, [0.5, 0.3, 0.2])
    ReferenceSample.objects.create(
        version=v1,
        source="upload",
        columns=ref,
        scores=rng.beta(2, 5, 400).round(4).tolist(),
        rows=400,
    )
    now = timezone.now()
    for i in range(8):
        make_log(
            v1,
            uuid.uuid4().hex,
            inputs=columns(rng, 50, 55, [0.5, 0.3, 0.2]),
            scores=rng.beta(2, 5, 50).round(4).tolist(),
            latency_ms=3.0,
            at=now - timedelta(minutes=20 - i),
        )
    world.reports = [
        drift.detect_drift(v1, now - timedelta(minutes=2)),
        drift.detect_drift(v1, now),
    ]
    RolloutPolicy.objects.create(tenant=world.a, max_weight_without_approval=20)
    actions.start_plan(model, "canary", v2, RAILS, Actor(None, "test"), weight=20)
    for minutes in (1, 2, 3):
        traffic(v1, now - timedelta(minutes=minutes), 80, 0, 0.004)
        traffic(v2, now - timedelta(minutes=minutes), 18, 2, 0.03)
    secret = make_model(world.b, "secret-b")
    make_version(secret, onnx_bytes)
    raise_alert(world.b.pk, "drift", "drift:b", "secret-b drifted", "PSI 9", model_id=secret.pk)
    world.model, world.v1, world.v2, world.secret = model, v1, v2, secret
    return world


def embedded(page: str) -> dict:
    return json.loads(page.split('id="snapshot" type="application/json">')[1].split("</script>")[0])


# Drift ---------------------------------------------------------------------------------------


def test_the_drift_page_charts_real_reports_of_the_production_version(site):
    assert all(r is not None for r in site.reports), "detect_drift made no report"
    response = signed_in(site.viewer_a).get("/models/clf/drift/")
    assert response.status_code == 200
    page = response.content.decode()
    for chart in ("chart-psi", "chart-histogram", "chart-latency", "chart-errors"):
        assert f'id="{chart}"' in page
    assert "vendor/plotly.min.js" in page and "ui/drift.js" in page
    snapshot = embedded(page)
    assert snapshot["version"] == 1 and snapshot["versions"] == [2, 1]
    assert snapshot["empty"] is None
    psi = snapshot["psi"]
    assert len(psi["t"]) == 2 and psi["threshold"] == [0.2, 0.2]
    assert psi["features"]["age"][-1] == pytest.approx(site.reports[-1].features["age"]["psi"])
    assert psi["features"]["age"][-1] > 0.2  # the shift is seen
    assert len(psi["score"]) == 2


def test_the_histogram_defaults_to_the_most_drifted_feature_and_follows_the_choice(site):
    client = signed_in(site.viewer_a)
    histogram = client.get("/models/clf/drift/data/").json()["histogram"]
    assert histogram["feature"] == "age" and histogram["flagged"]
    assert histogram["choices"][0] == "age" and "country" in histogram["choices"]
    entry = site.reports[-1].features["age"]
    assert histogram["reference"] == entry["reference"]
    assert len(histogram["bins"]) == len(entry["reference"])
    assert histogram["bins"][0].startswith("< ") and histogram["bins"][-1].startswith("≥ ")
    country = client.get("/models/clf/drift/data/?feature=country").json()["histogram"]
    assert country["feature"] == "country" and country["bins"][:3] == ["de", "fr", "us"]
    unknown = client.get("/models/clf/drift/data/?feature=nope").json()["histogram"]
    assert unknown["feature"] == "age"


def test_the_latest_report_table_has_distances_and_quality_counts(site):
    latest = signed_in(site.viewer_a).get("/models/clf/drift/data/").json()["latest"]
    assert latest["rows_current"] == 400 and latest["rows_reference"] == 400
    assert "age" in latest["flagged"]
    rows = {r["feature"]: r for r in latest["features"]}
    assert set(rows) == {"age", "country", "score"}
    assert latest["features"][0]["feature"] == "age"  # worst first
    assert rows["age"]["ks"] is not None and rows["country"]["distance"] is not None
    # A shift to N(55, 10) puts many ages above the reference's largest.
    assert rows["age"]["out_of_range"] > 0
    assert rows["country"]["nulls"] == 0 and rows["country"]["schema"] == 0


def test_latency_and_errors_are_charted_per_version_and_arm(site):
    series = signed_in(site.viewer_a).get("/models/clf/drift/data/").json()["traffic"]
    assert set(series) == {"v1 · baseline", "v2 · candidate"}
    candidate = series["v2 · candidate"]
    assert len(candidate) == 3
    assert {p["error_rate"] for p in candidate} == {0.1}
    assert {p["p99_ms"] for p in candidate} == {50}  # 30 ms falls in the (20, 50] bucket
    assert {p["p50_ms"] for p in series["v1 · baseline"]} == {5}
    assert set(candidate[0]) == {"t", "requests", "error_rate", "p50_ms", "p95_ms", "p99_ms"}


def test_a_version_without_reference_says_how_to_upload_one(site):
    response = signed_in(site.viewer_a).get("/models/clf/drift/?version=2")
    page = response.content.decode()
    snapshot = embedded(page)
    assert snapshot["version"] == 2 and snapshot["psi"] is None and snapshot["latest"] is None
    assert "No reference sample uploaded yet for v2" in snapshot["empty"]
    assert "/api/v1/models/clf/versions/2/reference" in page  # rendered in the first paint


def test_a_reference_without_logged_predictions_says_to_send_traffic(site):
    ReferenceSample.objects.create(
        version=site.v2, source="upload", columns={"age": [1.0] * 40}, rows=40
    )
    data = signed_in(site.viewer_a).get("/models/clf/drift/data/?version=2").json()
    assert data["empty"].startswith("No logged predictions for v2 yet")
    assert data["reference"]["rows"] == 40


def test_predictions_without_a_report_yet_say_when_one_comes(site):
    make_log(site.v2, "one-for-v2", inputs={"age": [50.0]}, scores=[0.3])
    ReferenceSample.objects.create(
        version=site.v2, source="upload", columns={"age": [1.0] * 40}, rows=40
    )
    data = signed_in(site.viewer_a).get("/models/clf/drift/data/?version=2").json()
    assert data["empty"].startswith("No drift report yet")


def test_another_tenants_model_is_404_on_the_drift_page_and_its_data(site):
    client = signed_in(site.engineer_a)
    assert client.get("/models/secret-b/drift/").status_code == 404
    assert client.get("/models/secret-b/drift/data/").status_code == 404
    b_member = signed_in(make_member(site.b, "eng-b", "engineer"))
    assert b_member.get("/models/clf/drift/").status_code == 404
    assert b_member.get("/models/clf/drift/data/").status_code == 404


def test_the_model_page_links_to_its_drift_page(site):
    page = signed_in(site.viewer_a).get("/models/clf/").content.decode()
    assert 'href="/models/clf/drift/"' in page


def test_pages_require_sign_in(db):
    for path in (
        "/models/clf/drift/",
        "/models/clf/drift/data/",
        "/slo/",
        "/slo/data/",
        "/alerts/",
    ):
        response = Client().get(path)
        assert response.status_code == 302 and response["Location"].startswith("/login/")


# SLOs ----------------------------------------------------------------------------------------


def test_the_slo_page_shows_each_model_of_the_tenant_with_both_slis(site):
    response = signed_in(site.viewer_a).get("/slo/")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-model="clf"' in page and 'data-chart="clf"' in page
    # The overview first: one row per model and SLI, linking to the model's section.
    assert page.index('id="slo-overview"') < page.index('data-chart="clf"')
    assert page.count('data-overview="clf"') == 2 and 'href="#slo-clf"' in page
    assert "secret-b" not in page
    assert '<a href="/slo/" class="active">SLOs</a>' in page
    assert "over the last 30 days" in page
    (model,) = embedded(page)["models"]
    assert model["model"] == "clf" and model["window_days"] == 30
    availability, latency = model["slis"]
    assert availability["sli"] == "availability" and latency["sli"] == "latency"
    assert availability["requests"] == 300 and availability["bad"] == 6
    assert availability["value"] == pytest.approx(0.98)
    # 2 % bad against the 0.1 % a 99.9 % objective allows: twenty budgets spent.
    assert availability["budget_remaining"] == pytest.approx(-19.0)
    assert availability["alert"] == "critical"
    assert latency["value"] == 1.0 and latency["budget_remaining"] == 1.0


def test_the_slo_data_has_the_burn_rates_and_the_chart_series(site):
    data = signed_in(site.viewer_a).get("/slo/data/").json()
    (model,) = data["models"]
    assert set(model["slis"][0]["burn"]) == {"5m", "30m", "1h", "6h"}
    series = model["series"]
    assert set(series) == {"t", "availability_1h", "availability_5m", "latency_1h", "latency_5m"}
    assert len(series["t"]) == len(series["availability_1h"]) == 6 * 60 + 1
    assert series["availability_1h"][-1] == pytest.approx(20.0)


def test_another_tenant_sees_only_its_own_slos(site):
    b_member = signed_in(make_member(site.b, "eng-b", "engineer"))
    data = b_member.get("/slo/data/").json()
    assert [m["model"] for m in data["models"]] == ["secret-b"]
    assert data["models"][0]["slis"][0]["requests"] == 0


def test_a_tenant_without_models_gets_the_empty_state(world):
    gamma_viewer = make_member(make_tenant("gamma"), "gamma-viewer", "viewer")
    page = signed_in(gamma_viewer).get("/slo/").content.decode()
    assert "No models yet" in page


# Alerts --------------------------------------------------------------------------------------


@pytest.fixture
def alerted(site):
    site.open_alert, _ = raise_alert(
        site.a.pk,
        "drift",
        f"drift:{site.v1.pk}",
        "Drift on clf v1",
        "age PSI 1.20 (threshold 0.2)",
        model_id=site.model.pk,
    )
    site.resolved_alert, _ = raise_alert(
        site.a.pk, "rollback", "rollback:1", "clf: rollout #1 rolled back", "p99"
    )
    resolve_alert(site.a.pk, "rollback:1")
    return site


def test_the_alerts_page_lists_open_and_resolved_alerts_with_a_resolve_button(alerted):
    page = signed_in(alerted.engineer_a).get("/alerts/").content.decode()
    open_part, resolved_part = page.split('id="resolved"')
    assert f'data-resolve="{alerted.open_alert.pk}"' in open_part
    assert "Drift on clf v1" in open_part and 'href="/models/clf/drift/"' in open_part
    assert "clf: rollout #1 rolled back" in resolved_part
    assert "secret-b drifted" not in page
    assert '<span class="count" data-alert-count>1</span>' in page  # the nav badge
    assert 'id="webhook-url"' in page


def test_viewers_get_no_resolve_button_and_no_webhook_url(alerted):
    alerted.a.alert_webhook_url = "https://hooks.slack.com/services/T0/B0/SECRET"
    alerted.a.save()
    page = signed_in(alerted.viewer_a).get("/alerts/").content.decode()
    assert "data-resolve=" not in page
    assert "SECRET" not in page and 'id="webhook-url"' not in page


def test_the_open_alert_count_is_in_the_nav_of_every_page(alerted):
    page = signed_in(alerted.viewer_a).get("/").content.decode()
    assert '<span class="count" data-alert-count>1</span>' in page
    b_page = signed_in(make_member(alerted.b, "eng-b", "engineer")).get("/").content.decode()
    assert '<span class="count" data-alert-count>1</span>' in b_page  # B's own, not A's
    resolve_alert(alerted.a.pk, alerted.open_alert.key)
    assert "data-alert-count" not in signed_in(alerted.viewer_a).get("/").content.decode()
