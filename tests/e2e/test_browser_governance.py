"""The governance parts of the web UI in a real browser (headless Chromium driven by Playwright)
against a real server: an engineer creates a model and uploads a version with a progress bar that
reaches 100 %; the rollout page's step timeline with its live bake countdown, and a slider that
sends nothing until "Apply weight"; the online quality chart with a single time bucket; and a
phone-sized screen (390 px) where the top bar wraps and the audit table's key columns stay in view.
Screenshots go to docs/screenshots/ (self-service-upload, rollout-timeline, phone-topbar)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.onnx_models import small_onnx

from .conftest import make_backend
from .harness import create_tenant, free_port, start_server
from .test_browser import CHROMIUM, CREATE_USERS, VIEWPORT, browser, shot, sign_in  # noqa: F401

pytestmark = pytest.mark.e2e

# Long enough to push a table's other columns off a phone's screen unless names wrap.
MODEL = "customer-lifetime-value-regressor-trained-on-the-2026-q3-snapshot-with-extra-features"
PHONE = {"width": 390, "height": 844}
USERS = {"erin": "engineer", "vic": "viewer"}

# One logged and labelled prediction: the quality chart has a single hourly bucket.
ONE_BUCKET = """
from django.utils import timezone
from monitoring.models import Feedback
from monitoring.prediction_log import write_records
from registry.models import ModelVersion
v = ModelVersion.objects.select_related("model").get(model__name="{name}", version=1)
write_records([dict(
    tenant_id=v.model.tenant_id, model_id=v.model_id, version_id=v.pk, request_id="one",
    inputs={{}}, outputs={{}}, scores=[0.4], latency_ms=2.0, status=200,
    created_at=timezone.now(),
)])
Feedback.objects.create(tenant_id=v.model.tenant_id, request_id="one", label=0.5,
                        received_at=timezone.now())
"""


@pytest.fixture
def server(tmp_path):
    """The embedded backend and one uvicorn server: nothing here needs an agent."""
    users = CREATE_USERS.format(users=USERS)
    backend = make_backend("embedded", tmp_path, (("tenant", "acme"), ("shell", users)))
    port = free_port()
    proc = start_server(backend, "uvicorn", port)
    try:
        key = create_tenant(backend, "acme")
        backend.shell(users)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as api:
            yield url, api, backend
    finally:
        proc.stop()
        backend.close()


def test_self_service_timeline_and_phone_in_a_real_browser(browser, server):  # noqa: F811
    from playwright.sync_api import expect

    url, api, backend = server
    page = sign_in(browser, url, "erin")

    # A new model from the dashboard: a bad name is answered inline, a good one opens it.
    expect(page.locator("#new-model")).to_have_attribute("open", "")  # no model yet: open
    page.fill("#nm-name", "no spaces!")
    page.click("text=Create model")
    expect(page.locator(".field-error")).to_be_visible()
    page.fill("#nm-name", MODEL)
    page.select_option("#nm-task", "regressor")
    page.fill("#nm-description", "made in the browser")
    page.click("text=Create model")
    page.wait_for_url(f"**/models/{MODEL}/")

    # Upload a version: the bar reaches 100 % and the new version is listed.
    page.set_input_files(
        "#up-artifact",
        {"name": "v1.onnx", "mimeType": "application/octet-stream", "buffer": small_onnx()},
    )
    page.fill("#up-description", "first cut")
    page.click("#upload-form button[type=submit]")
    expect(page.locator("[data-percent]")).to_have_text("100 %")
    expect(page.locator("#upload-form [data-msg]")).to_contain_text("Uploaded as v1")
    assert page.locator("#upload-form progress").evaluate("p => p.value") == 1
    shot(page, "self-service-upload")
    page.wait_for_url("**?uploaded=1")
    expect(page.locator('#versions tr[data-version="1"]')).to_be_visible()
    expect(page.locator("[data-uploaded]")).to_contain_text("v1 uploaded")

    # The server's refusal is shown as it says it: an artifact that is not ONNX.
    page.locator("#upload-version summary").click()
    page.set_input_files(
        "#up-artifact", {"name": "x.onnx", "mimeType": "text/plain", "buffer": b"not a model"}
    )
    page.click("#upload-form button[type=submit]")
    expect(page.locator("#upload-form [data-msg].error")).to_contain_text("artifact")

    # v1 in production, v2 uploaded, a canary at 5 % baking for 10 minutes per step.
    moved = api.put(f"/api/v1/models/{MODEL}/aliases/production", json={"version": 1})
    assert moved.status_code == 200, moved.text
    files = {"artifact": ("v2.onnx", small_onnx(seed=3), "application/octet-stream")}
    assert api.post(f"/api/v1/models/{MODEL}/versions", files=files).status_code == 201
    rails = {"max_error_rate_increase": 1, "max_p99_ratio": 100, "min_samples": 10**6}
    canary = {
        "mode": "canary",
        "candidate": 2,
        "weight": 5,
        "guardrails": rails,
        "steps": [1, 5, 25, 50, 100],
        "bake_seconds": 600,
        "max_weight": 50,
    }
    started = api.post(f"/api/v1/models/{MODEL}/rollouts", json=canary)
    assert started.status_code == 201, started.text
    plan_id = started.json()["id"]

    sent: list[str] = []
    page.on(
        "request",
        lambda r: sent.append(r.url) if r.method == "POST" and "/rollouts/" in r.url else None,
    )
    page.goto(f"/rollouts/{plan_id}/")
    pills = page.locator("[data-timeline] .pill")
    expect(pills).to_have_count(6)  # five steps and the end
    expect(page.locator('.pill.current[data-step-weight="5"]')).to_be_visible()
    expect(page.locator('.pill.skipped[data-step-weight="1"]')).to_be_visible()  # started at 5
    expect(page.locator('.pill[data-step-weight="100"]')).to_contain_text("approval")
    countdown = page.locator("[data-countdown]")
    expect(countdown).to_have_text(re.compile(r"^bakes (9:5\d|10:00) more$"))
    first = countdown.text_content()
    expect(countdown).not_to_have_text(first, timeout=3_000)  # it ticks

    # Arrow keys move the value shown and nothing else; "Apply weight" sends it.
    page.focus("#weight")
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    expect(page.locator("#weight-out")).to_have_text("8 %")
    expect(page.locator("#apply-weight")).to_have_text("Apply weight 8 %")
    page.wait_for_timeout(2_500)  # a live update arrives and must not undo the choice
    expect(page.locator("#weight-out")).to_have_text("8 %")
    assert sent == [] and api.get(f"/api/v1/rollouts/{plan_id}").json()["weight"] == 5
    page.click("#apply-weight")
    expect(page.locator("[data-msg]")).to_contain_text("candidate now gets 8 %")
    assert len(sent) == 1 and api.get(f"/api/v1/rollouts/{plan_id}").json()["weight"] == 8
    expect(page.locator('.pill.current[data-step-weight="8"]')).to_be_visible(timeout=5_000)
    expect(page.locator("#chart-rps .xtitle")).to_have_text("time (UTC)")
    expect(page.locator("[data-step-started]")).to_contain_text(" UTC")
    shot(page, "rollout-timeline")

    # The online quality chart with one bucket keeps its 48 h axis (Plotly alone would
    # spread one point over a millisecond).
    backend.shell(ONE_BUCKET.format(name=MODEL))
    page.goto(f"/models/{MODEL}/predictions/")
    expect(page.locator("#quality-chart .main-svg").first).to_be_visible()
    span_ms = page.evaluate(
        "() => { const r = document.getElementById('quality-chart')._fullLayout.xaxis.range;"
        " return new Date(r[1]) - new Date(r[0]); }"
    )
    assert span_ms >= 47 * 3600 * 1000, span_ms
    page.context.close()

    # A phone: the top bar wraps, nothing scrolls sideways, the audit's key columns show.
    page = sign_in(browser, url, "erin")
    page.set_viewport_size(PHONE)
    for path in ("/", "/audit/"):
        page.goto(path)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], (path, width)
    for name in ("When", "Actor", "Action"):
        box = page.locator("#audit th", has_text=name).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], (name, box)
    expect(page.locator("#audit")).to_contain_text("model.create")
    shot(page, "phone-topbar")
    page.goto("/")
    box = page.locator(f'tr[data-model="{MODEL}"] td').first.bounding_box()
    assert box and box["x"] + box["width"] <= PHONE["width"], box
    page.context.close()

    # At 1280 px the same columns are in view too.
    page = sign_in(browser, url, "vic")
    page.goto("/audit/")
    for name in ("When", "Actor", "Action"):
        box = page.locator("#audit th", has_text=name).bounding_box()
        assert box and box["x"] + box["width"] <= VIEWPORT["width"], (name, box)
    page.goto(f"/models/{MODEL}/")  # a viewer gets no upload form
    expect(page.locator("#upload-form")).to_have_count(0)
    page.context.close()
