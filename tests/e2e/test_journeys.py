"""Journeys, end to end in Chromium, as the people who use the platform walk them: two users
signed in through the real login page (an engineer, erin, and an approver, abe), real processes
(uvicorn, a serving agent, a Celery worker and beat) on PostgreSQL + Redis, and each journey
checked at its end state as a person sees it.

(a) A release: erin uploads v2 on the model page, starts a canary, asks for the promotion; abe
    approves it from his inbox; the guardrails step it to 100 % and promote it; production
    serves v2; erin rolls production back in one click; it serves v1 again.
(c) A first prediction: a new member creates an API key in the UI, pushes a model with the CLI,
    gets a first prediction (200) and sees its traffic on the dashboard.
Journeys (b), (d) and (e) of issue 30 are still to come; (e) passed here but stalled in CI (its
chunk never reached the worker while the reaper re-queued it), and is left out until that is
understood.

Screenshots of the end states go to docs/screenshots/ (journey-*.png)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import onnx
import pytest

from tests.onnx_models import small_onnx

from .conftest import platform_with_agent, upload_and_promote, wait_ready
from .harness import ROOT, allow_weight, create_tenant, wait_until
from .test_browser import BODY, CREATE_USERS, browser, shot, sign_in  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.serial]

USERS = {"erin": "engineer", "abe": "approver", "nia": "engineer"}
SEED = (
    ("tenant", "acme"),
    ("shell", CREATE_USERS.format(users=USERS)),
    ("weight", "acme", 50),
)
# The guardrails look every second: a step bakes for one and needs 20 requests per arm. A batch
# chunk whose worker is lost is leased again after 3 s, not a minute (as in test_batch_e2e.py).
ENV = {
    "SWITCHYARD_GUARDRAIL_INTERVAL_S": "1",
    "SWITCHYARD_BATCH_CHUNK_ROWS": "500",
    "SWITCHYARD_BATCH_LEASE_S": "3",
    "SWITCHYARD_BATCH_REAP_INTERVAL_S": "1",
}


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """One platform for the module (journeys use their own models): PostgreSQL + Redis, as in
    production, with the Celery worker and beat the guardrails and batch jobs run on."""
    tmp = tmp_path_factory.mktemp("journeys")
    with platform_with_agent("services", tmp, ENV, celery=True, seed=SEED) as started:
        backend, url, procs = started
        key = create_tenant(backend, "acme")
        backend.shell(CREATE_USERS.format(users=USERS))
        allow_weight(backend, "acme", 50)  # steps up to 50 % without an approver
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
            yield url, api, backend, procs


def test_a_release_from_upload_to_promotion_and_one_click_rollback(journey, browser):  # noqa: F811
    from playwright.sync_api import expect

    url, api, backend, procs = journey
    upload_and_promote(api, "fraud", small_onnx(), offline_metrics='{"auc": 0.91}')
    wait_ready(api, "fraud", 60, procs[1])
    # v2: the same graph, rebuilt (its scores do not drift from v1's, so the guardrails pass it).
    rebuilt = onnx.load_from_string(small_onnx())
    rebuilt.doc_string = "retrained on November"
    v2 = rebuilt.SerializeToString()

    # erin uploads v2 on the model page.
    erin = sign_in(browser, url, "erin")
    erin.goto("/models/fraud/")
    erin.locator("#upload-version summary").click()
    erin.set_input_files(
        "#up-artifact",
        {"name": "v2.onnx", "mimeType": "application/octet-stream", "buffer": v2},
    )
    erin.fill("#up-description", "retrained on November")
    erin.click("#upload-form button[type=submit]")
    erin.wait_for_url("**?uploaded=2")

    # ... starts a canary from the same page ...
    erin.goto("/models/fraud/")
    erin.select_option("#candidate", "2")
    erin.fill("#weight", "5")
    erin.fill("#steps", "5, 25, 50, 100")
    erin.fill("#bake_seconds", "1")
    erin.fill("#max_p99_ratio", "50")
    erin.fill("#min_samples", "20")
    erin.click("text=Start canary on production")
    erin.wait_for_url("**/rollouts/*/")
    plan_id = int(erin.url.rstrip("/").rsplit("/", 1)[1])
    expect(erin.locator("[data-split] .legend")).to_contain_text("candidate v2 · 5 %")
    # The plan's candidate is loaded once the plan routes to it.
    wait_until(lambda: api.get("/v2/models/fraud/versions/2/ready").status_code == 200, 60)

    # ... and asks for the promotion.
    erin.fill("#promotion-comment", "AUC 0.93 offline, flat error rate at 5 %")
    erin.click('[data-action="promotion"]')
    expect(erin.locator("[data-msg]")).to_contain_text("Promotion sent for approval")
    approval_path = erin.locator("[data-msg] a").get_attribute("href")

    # abe approves it from his inbox.
    abe = sign_in(browser, url, "abe")
    abe.click("nav >> text=Approvals")
    abe.click(f'#pending a[href="{approval_path}"]')
    abe.fill("#decision-comment", "numbers look fine")
    abe.click('[data-decision="approve"]')
    expect(abe.locator(".page-head [data-state]")).to_have_text("Approved")

    # Traffic flows; the guardrails step the plan to 100 % (the approved promotion clears
    # every step) and promote it once the last step is healthy.
    def plan() -> dict:
        return api.get(f"/api/v1/rollouts/{plan_id}").json()

    def serve_then_promoted() -> bool:
        for i in range(40):
            r = api.post("/v2/models/fraud/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
            assert r.status_code == 200, r.text
        return plan()["state"] == "promoted"

    try:
        wait_until(serve_then_promoted, 120, procs[-1], interval=0.5)
    except TimeoutError:
        pytest.fail(f"the approved promotion never landed: {plan()}")

    # What erin sees: the timeline ran to the end, production points at v2 and serves it.
    erin.goto(f"/rollouts/{plan_id}/")
    expect(erin.locator('.pill.end[data-end="promoted"]')).to_be_visible()
    erin.goto("/models/fraud/")
    expect(erin.locator("table").first).to_contain_text("v2")
    served = api.post("/v2/models/fraud/infer", json=BODY).json()
    assert served["model_version"] == "2"

    # One click rolls production back to v1.
    erin.goto("/models/fraud/aliases/production/")
    erin.fill("#rollback-reason", "conversion dropped after the release")
    erin.click("#rollback-button")
    erin.wait_for_load_state("load")
    wait_until(
        lambda: api.post("/v2/models/fraud/infer", json=BODY).json()["model_version"] == "1", 15
    )
    erin.goto("/models/fraud/")
    expect(erin.locator("table").first).to_contain_text("v1")
    shot(erin, "journey-release")
    erin.context.close()
    abe.context.close()


def test_a_new_member_gets_a_first_prediction_and_sees_it(journey, browser, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    url, api, backend, procs = journey
    # nia creates a key in the UI; it is shown once.
    nia = sign_in(browser, url, "nia")
    nia.goto("/keys/")
    nia.fill("#k-name", "nia's laptop")
    nia.check('#key-create input[name="scopes"][value="deploy"]')
    nia.click("#key-create button[type=submit]")
    raw = nia.locator("[data-raw-key]").inner_text().strip()
    assert raw.startswith("sy"), raw

    # She pushes a model with the CLI and points production at it.
    env = {**os.environ, "SWITCHYARD_URL": url, "SWITCHYARD_KEY": raw}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    artifact = tmp_path / "churn.onnx"
    artifact.write_bytes(small_onnx(seed=5))

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "switchyard_client.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    cli("models", "create", "churn")
    cli("push", "churn", str(artifact), "--format", "onnx")
    cli("alias", "set", "churn", "production", "1")

    # Her first prediction: 200 once the agent has loaded it (until then 503, "not ready").
    request = tmp_path / "request.json"
    request.write_text(json.dumps(BODY))
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {raw}"}) as own:
        wait_until(lambda: own.post("/v2/models/churn/infer", json=BODY).status_code == 200, 60)
    answer = json.loads(cli("predict", "churn", "--input", f"@{request}", "--json"))
    assert answer["model_name"] == "churn" and answer["outputs"]

    # ... and sees it on the dashboard once the gateway has flushed its counts (every 5 s).
    nia.goto("/")
    rate = nia.locator('tr[data-model="churn"] [data-field="rps"]')
    expect(rate).to_be_visible()
    expect(rate).not_to_have_text("0.00/s", timeout=20_000)
    shot(nia, "journey-first-prediction")
    nia.context.close()
