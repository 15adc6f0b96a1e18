"""The web UI in a real browser (headless Chromium driven by Playwright) against real processes:
an engineer signs in, starts a canary, applies a weight and sees the split change on the page
and in the routing of later requests; above the plan's bound the slider asks for approval; the
engineer asks for a promotion but cannot approve it; an approver approves it from the inbox;
the fleet page charts a deployment's recorded decisions. Screenshots of the main pages are saved
under docs/screenshots/."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.onnx_models import small_onnx

from .conftest import BACKENDS, platform_with_agent, upload_and_promote, wait_ready
from .harness import ROOT, allow_weight, create_tenant, wait_until

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = ROOT / "docs" / "screenshots"
VIEWPORT = {"width": 1280, "height": 800}
BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1] * 4}]}
USERS = {"erin": "engineer", "abe": "approver"}

CREATE_USERS = """
from django.contrib.auth import get_user_model
from tenants.models import Membership, Tenant
tenant = Tenant.objects.get(slug="acme")
for name, role in {users!r}.items():
    user = get_user_model().objects.create_user(name, password=f"pw-{{name}}-12345")
    Membership.objects.create(tenant=tenant, user=user, role=role)
"""


# A deployment of fraud v2 on a Kubernetes pool with half an hour of decisions: a burst scales
# it from 1 to 4 replicas, then back down after the window (no control loop runs here).
RECORDED_FLEET = """
from datetime import timedelta
from django.utils import timezone
from registry.models import ModelVersion
from fleet.models import Deployment, Pool, ScalingDecision
version = ModelVersion.objects.get(model__name="fraud", version=2)
pool = Pool.objects.create(name="gpu-a100", backend="kubernetes", namespace="ml")
d = Deployment.objects.create(
    tenant=version.model.tenant, version=version, pool=pool, max_replicas=6, desired_replicas=1,
    target_load_per_replica=8, slo_p99_ms=250, applied_template="recorded",
)
now = timezone.now()
replicas = 1
for minute, load in enumerate([3, 4, 6, 9, 22, 30, 28, 31, 26, 12, 7, 6, 5, 4, 4, 3, 3, 2]):
    wanted = max(1, -(-load // 8))
    reason = (f"up: load {load} at 8 per replica → {wanted}" if wanted > replicas
              else f"hold: load {load} at 8 per replica → {wanted}")
    if wanted < replicas and minute > 12:
        reason = f"down: highest need over 120 s is {wanted}"
    elif wanted < replicas:
        wanted = replicas
    inputs = {"queue_depth": load * 0.6, "in_flight": load * 0.4, "p99_ms": 40 + 8 * load,
              "requests": load * 300, "pending": 0, "actual": replicas, "ready": replicas}
    ScalingDecision.objects.create(
        deployment=d, created_at=now - timedelta(minutes=18 - minute), current=replicas,
        desired=wanted, accepted=wanted, reason=reason, inputs=inputs,
    )
    replicas = wanted
Deployment.objects.filter(pk=d.pk).update(desired_replicas=replicas)
print(d.pk)
"""


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium to run the browser test")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


# One platform per module and backend: the two tests use models of their own (fraud, churn).
@pytest.fixture(scope="module", params=BACKENDS)
def platform(request, tmp_path_factory):
    # Tenant acme with its users, and the slider's bound: 30 % applies, 80 % asks.
    seed = (("tenant", "acme"), ("shell", CREATE_USERS.format(users=USERS)), ("weight", "acme", 50))
    tmp_path = tmp_path_factory.mktemp(f"browser-{request.param}")
    with platform_with_agent(request.param, tmp_path, seed=seed) as (backend, url, procs):
        key = create_tenant(backend, "acme")
        backend.shell(CREATE_USERS.format(users=USERS))
        allow_weight(backend, "acme", 50)  # the slider's bound: 30 % applies, 80 % asks
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
            upload_and_promote(api, "fraud", small_onnx(), offline_metrics='{"auc": 0.91}')
            files = {"artifact": ("v2.onnx", small_onnx(seed=3), "application/octet-stream")}
            data = {"offline_metrics": '{"auc": 0.93}', "source_commit": "9e1d7c0"}
            v2 = api.post("/api/v1/models/fraud/versions", files=files, data=data)
            assert v2.status_code == 201, v2.text
            wait_ready(api, "fraud", proc=procs[1])
            yield url, api, backend


def sign_in(browser, url: str, username: str):
    context = browser.new_context(base_url=url, viewport=VIEWPORT)
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.goto("/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", f"pw-{username}-12345")
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/")
    return page


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def candidate_share(api: httpx.Client, n: int = 400) -> float:
    """Share of n distinct routing keys the gateway sends to the candidate."""
    arms = []
    for i in range(n):
        r = api.post("/v2/models/fraud/infer", json=BODY, headers={"X-User-Id": f"user-{i}"})
        assert r.status_code == 200, r.text
        assert r.headers["x-switchyard-arm"] == r.json()["parameters"]["arm"]
        arms.append(r.headers["x-switchyard-arm"])
    return arms.count("candidate") / n


def test_canary_slider_and_approval_in_a_real_browser(browser, platform):
    from playwright.sync_api import expect

    url, api, backend = platform

    # Sign-in page, then the engineer's dashboard.
    page = browser.new_context(base_url=url, viewport=VIEWPORT).new_page()
    page.goto("/login/")
    shot(page, "sign-in")
    page.context.close()
    page = sign_in(browser, url, "erin")
    expect(page.locator("[data-user]")).to_contain_text("erin · engineer")

    # Start a canary at 5 % from the model page.
    page.click('a[href="/models/fraud/"]')
    page.wait_for_url("**/models/fraud/")
    expect(page.locator("#versions tr[data-version]")).to_have_count(2)
    page.fill("#bake_seconds", "600")
    page.click("text=Start canary on production")
    page.wait_for_url("**/rollouts/*/")
    plan_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    legend = page.locator("[data-split] .legend")
    expect(legend).to_contain_text("candidate v2 · 5 %")
    expect(page.locator("[data-live]")).to_have_text("live")
    wait_until(lambda: api.get("/v2/models/fraud/versions/2/ready").status_code == 200, 30)

    page.evaluate("window.sameDocument = true")  # gone if anything reloads the page

    # Within the plan's bound the chosen weight applies at once: the page and the routing follow.
    page.locator("#weight").fill("30")
    page.click("#apply-weight")  # the slider alone sends nothing (test_browser_governance)
    expect(page.locator("[data-msg]")).to_contain_text("candidate now gets 30 %")
    expect(legend).to_contain_text("candidate v2 · 30 %")
    assert api.get(f"/api/v1/rollouts/{plan_id}").json()["weight"] == 30
    shares: list[float] = []

    def routed_at_30() -> bool:  # gateways pick the change up within their refresh interval
        shares.append(candidate_share(api))
        return abs(shares[-1] - 0.30) < 0.07

    wait_until(routed_at_30, 20, interval=0.5)

    # The per-arm table and the charts fill from the live socket, without a reload.
    requests = page.locator('#arms tr[data-arm="candidate"] [data-field="requests"]')
    expect(requests).not_to_have_text("0", timeout=20_000)
    expect(page.locator("#chart-rps .main-svg").first).to_be_visible()
    assert page.evaluate("window.sameDocument") is True

    # Above the bound (50 %) the slider asks an approver instead, and the split stays.
    page.locator("#weight").fill("80")
    page.click("#apply-weight")
    expect(page.locator("[data-msg]")).to_contain_text("sent for approval")
    expect(legend).to_contain_text("candidate v2 · 30 %")
    assert page.locator("#weight").input_value() == "30"
    expect(page.locator("#requests")).to_contain_text("weight → 80 %")  # live, no reload
    shot(page, "rollout")

    # The engineer asks for a promotion and cannot approve it: no buttons, and the API refuses.
    page.fill("#promotion-comment", "30 % for a while, error rate flat")
    page.click('[data-action="promotion"]')
    expect(page.locator("[data-msg]")).to_contain_text("Promotion sent for approval")
    link = page.locator("[data-msg] a")
    approval_path = link.get_attribute("href")
    approval_id = int(approval_path.strip("/").rsplit("/", 1)[1])
    link.click()
    page.wait_for_url(f"**{approval_path}")
    expect(page.locator('[data-decision="approve"]')).to_have_count(0)
    expect(page.locator("[data-own-request]")).to_be_visible()
    refused = page.evaluate(
        f"Sy.api('POST', '/api/v1/approvals/{approval_id}/approve', {{comment: 'mine'}})"
    )
    assert refused["status"] == 403, refused

    page.goto("/")
    expect(page.locator('tr[data-model="fraud"] [data-field="rps"]')).not_to_have_text("0.00/s")
    expect(page.locator('tr[data-model="fraud"] .legend')).to_contain_text("candidate v2 · 30 %")
    shot(page, "dashboard")
    page.goto("/models/fraud/")
    shot(page, "model")
    page.context.close()

    # The approver finds it in the inbox and approves it with a comment.
    page = sign_in(browser, url, "abe")
    expect(page.locator("[data-pending-count]")).to_have_text("2")  # promotion and weight
    page.click("nav >> text=Approvals")
    page.wait_for_url("**/approvals/")
    shot(page, "approvals")
    page.click(f'#pending a[href="{approval_path}"]')
    page.wait_for_url(f"**{approval_path}")
    expect(page.locator("#evidence")).to_contain_text("candidate − baseline")
    page.fill("#decision-comment", "error rate and p99 on par with the baseline")
    page.click('[data-decision="approve"]')
    expect(page.locator("dl[data-decision]")).to_contain_text("abe")
    expect(page.locator(".page-head [data-state]")).to_have_text("Approved")
    shot(page, "approval")

    decided = api.get(f"/api/v1/approvals/{approval_id}").json()
    assert (decided["state"], decided["decided_by"]) == ("approved", "abe")
    assert decided["decision_comment"] == "error rate and p99 on par with the baseline"

    page.click("nav >> text=Audit")
    expect(page.locator("#audit")).to_contain_text("approval.approve")
    shot(page, "audit")

    # The fleet page: a deployment's replicas over time from its recorded decisions, and the
    # agents serving the tenant.
    deployment_id = int(backend.shell(RECORDED_FLEET).strip().splitlines()[-1])
    page.click("nav >> text=Fleet")
    page.wait_for_url("**/fleet/")
    expect(page.locator(f"#chart-{deployment_id} .main-svg").first).to_be_visible()
    expect(page.locator("#fleet")).to_contain_text("up: load 22 at 8 per replica")
    expect(page.locator("#agents")).to_contain_text("fraud v1")
    shot(page, "fleet")
    page.context.close()


# Monitoring: model ``churn`` (v1 in production, a canary towards v2) with a reference sample,
# 80 minutes of logged predictions whose spend and support calls move away from it after the
# first half hour, a drift report every 5 minutes over the last hour (monitoring.drift), three hours
# of traffic in which the candidate starts failing, and the SLO evaluation that alerts on it.
SEED_MONITORING = """
import uuid
from datetime import timedelta
import numpy as np
from django.utils import timezone
from monitoring.models import TrafficSample
from monitoring.prediction_log import write_records
from monitoring.traffic import Counts
from registry.models import ModelVersion
from monitoring import drift
from registry.models import ReferenceSample
from monitoring.slo import evaluate_slos

rng = np.random.default_rng(7)
v1 = ModelVersion.objects.select_related("model").get(model__name="churn", version=1)
v2 = ModelVersion.objects.get(model=v1.model, version=2)
model = v1.model
model.drift_window_minutes = 15
model.save(update_fields=["drift_window_minutes"])
now = timezone.now()

def columns(n, shift):  # shift 0: the reference's distribution; 1: fully moved
    spend = rng.normal(60 + 30 * shift, 15, n).round(2)
    return {
        "tenure_months": rng.gamma(2.0, 12.0, n).round(1).tolist(),
        "monthly_spend": [None if rng.random() < 0.03 * shift else float(v) for v in spend],
        "support_calls": np.minimum(rng.poisson(1 + 2.5 * shift, n), 8).tolist(),
        "discount_pct": rng.choice([0, 5, 10, 20], n, p=[0.5, 0.2, 0.2, 0.1]).tolist(),
    }

def scores(n, shift):
    return rng.beta(2 + 2 * shift, 5 - 2 * shift, n).round(4).tolist()

ReferenceSample.objects.create(
    version=v1, source="upload", columns=columns(2000, 0), scores=scores(2000, 0), rows=2000
)
logged = []
for minute in range(80):
    shift = min(max((minute - 30) / 40, 0), 1)
    logged.append(dict(
        tenant_id=model.tenant_id, model_id=model.pk, version_id=v1.pk, arm="baseline",
        request_id=uuid.uuid4().hex, inputs=columns(25, shift), scores=scores(25, shift),
        latency_ms=4.0, status=200, created_at=now - timedelta(minutes=80 - minute),
    ))
write_records(logged)
for k in range(12):
    assert drift.detect_drift(v1, now - timedelta(minutes=55 - 5 * k)) is not None

samples = []
for step in range(360):  # every 30 s over 3 hours
    at = now - timedelta(seconds=30 * (360 - step))
    for version, n, ms, error_rate in (
        (v1, 50, 4.0, 0.0005),
        (v2, 12 if step >= 280 else 0, 9.0, 0.25 if step >= 300 else 0.002),
    ):
        counts = Counts()
        for latency in rng.lognormal(np.log(ms), 0.5, n):
            counts.add(latency / 1000, ok=rng.random() >= error_rate)
        if n:
            samples.append(TrafficSample(
                version=version, window_end=at, requests=counts.requests, errors=counts.errors,
                latency_buckets=counts.buckets,
            ))
TrafficSample.objects.bulk_create(samples)
assert evaluate_slos()[model.pk] == {"availability": "critical", "latency": None}
"""


def test_drift_slo_and_alert_pages_in_a_real_browser(browser, platform):
    from playwright.sync_api import expect

    url, api, backend = platform
    names = '["tenure_months", "monthly_spend", "support_calls", "discount_pct"]'
    upload_and_promote(api, "churn", small_onnx(seed=5), feature_names=names)
    files = {"artifact": ("v2.onnx", small_onnx(seed=6), "application/octet-stream")}
    v2 = api.post("/api/v1/models/churn/versions", files=files, data={"feature_names": names})
    assert v2.status_code == 201, v2.text
    # Guardrails that never act (no Celery runs here anyway): the page shows what happened.
    rails = {"max_error_rate_increase": 1, "max_p99_ratio": 100, "min_samples": 10**6}
    canary = {"mode": "canary", "candidate": 2, "weight": 20, "guardrails": rails}
    started = api.post("/api/v1/models/churn/rollouts", json=canary)
    assert started.status_code == 201, started.text
    backend.shell(SEED_MONITORING)
    # Live traffic on both arms as well, through the gateway and the agent.
    wait_ready(api, "churn")
    wait_until(lambda: api.get("/v2/models/churn/versions/2/ready").status_code == 200, 30)
    for i in range(60):
        r = api.post("/v2/models/churn/infer", json=BODY, headers={"X-User-Id": f"user-{i}"})
        assert r.status_code == 200, r.text

    page = sign_in(browser, url, "erin")
    expect(page.locator("[data-alert-count]")).to_have_text("2")  # drift and SLO burn
    page.goto("/models/churn/")
    page.click("text=Drift and data quality")
    page.wait_for_url("**/models/churn/drift/")
    for chart in ("psi", "histogram", "latency", "errors"):
        expect(page.locator(f"#chart-{chart} .main-svg").first).to_be_visible()
    assert page.locator(".js-plotly-plot .main-svg").count() >= 8  # two layers per chart
    expect(page.locator("#feature")).to_have_value("monthly_spend")  # the most drifted
    expect(page.locator('#features tr[data-feature="monthly_spend"]')).to_contain_text("drifted")
    expect(page.locator("#chart-latency")).to_contain_text("v2 · candidate")

    # Another feature's histogram comes from the JSON endpoint, without a reload.
    page.evaluate("window.sameDocument = true")
    page.select_option("#feature", "support_calls")
    expect(page.locator("#chart-histogram")).to_contain_text("support_calls · PSI")
    expect(page.locator("[data-live]")).to_contain_text("updated", timeout=10_000)
    assert page.evaluate("window.sameDocument") is True
    page.select_option("#feature", "monthly_spend")
    expect(page.locator("#chart-histogram")).to_contain_text("monthly_spend · PSI")
    shot(page, "drift")

    page.click("nav >> text=SLOs")
    page.wait_for_url("**/slo/")
    section = page.locator('section[data-model="churn"]')
    expect(section.locator(".main-svg").first).to_be_visible()
    expect(section.locator('tr[data-sli="availability"] [data-field="alert"]')).to_have_text(
        "critical"
    )
    expect(section.locator('tr[data-sli="availability"] .budget')).to_be_visible()
    shot(page, "slo")

    # The alert, resolved from the alerts page through the REST API.
    page.click("nav >> text=Alerts")
    page.wait_for_url("**/alerts/")
    row = page.locator("#open tr", has_text="churn: availability SLO")
    expect(row).to_contain_text("Burn rate")
    shot(page, "alerts")
    row.locator("[data-resolve]").click()
    expect(page.locator("[data-msg]")).to_contain_text("Resolved")
    expect(page.locator("[data-alert-count]")).to_have_text("1")  # the drift alert is left
    assert api.get("/api/v1/alerts?kind=slo_burn").json() == []
    assert [a["kind"] for a in api.get("/api/v1/alerts").json()] == ["drift"]

    # The usage page charts the day's seeded traffic once it is rolled up (the beat task).
    backend.shell("from monitoring.usage import roll_up; roll_up()")
    page.goto("/usage/")
    for chart in ("cost-chart", "units-chart"):
        expect(page.locator(f"#{chart} .main-svg").first).to_be_visible()
    expect(page.locator("#units-chart")).to_contain_text("requests")
    shot(page, "usage")
    page.context.close()
