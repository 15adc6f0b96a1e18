"""Journeys, end to end in Chromium, as the people who use the platform walk them: two users
signed in through the real login page in each, real processes (uvicorn, a serving agent, a Celery
worker and beat) on PostgreSQL + Redis, and each journey checked at its end state as a person
sees it. One platform serves the module: each journey has models of its own, (d) a tenant too.

(a) A release: erin uploads v2 on the model page, starts a canary, asks for the promotion; abe
    approves it from his inbox; the guardrails step it to 100 % and promote it; production
    serves v2; erin rolls production back in one click; it serves v1 again.
(b) An A/B test under approval: erin starts one on production with her key, v1 at 40 % and v2
    at 60 %; past what an unapproved version may answer, v2's arm starts at 0 % and the split
    waits for abe, who approves it from his inbox; customers get both arms and their answers
    come back as feedback; the guardrails' sequential test declares v2's arm the winner on
    online accuracy (the rollout page says so) and ask for its promotion; abe approves it from
    his inbox; the guardrails carry it out and production serves v2.
(c) A first prediction: a new member creates an API key in the UI, pushes a model with the CLI,
    gets a first prediction (200) and sees its traffic on the dashboard.
(d) A budget: mona, the manager of another tenant, prices its usage and sets a monthly budget
    with a hard stop on the usage page; the day's usage priced past it, ed's service gets 429
    naming the budget; the usage page shows the costs in USD, the spend against the limit and
    that new work is refused, with mona's override; ed finds the alert saying so on the alerts
    page and the same explanation on the usage page, without the override.
(e) A batch job: erin submits a file of rows on the jobs page; the worker runs it chunk by
    chunk; its page follows it to the end (every row, 100 %, its rate, the download); nia finds
    it done in the jobs list and downloads one answer per row.

Screenshots of the end states go to docs/screenshots/ (journey-*.png)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import numpy as np
import onnx
import pytest

from tests.onnx_models import small_onnx

from .conftest import platform_with_agent, upload_and_promote, wait_ready
from .harness import ROOT, allow_weight, create_tenant, wait_until
from .test_browser import BODY, CREATE_USERS, VIEWPORT, browser, shot, sign_in  # noqa: F401

pytestmark = pytest.mark.e2e

USERS = {"erin": "engineer", "abe": "approver", "nia": "engineer"}
# Another tenant for the budget journey (d), so its hard stop refuses nobody else's requests:
# mona is its manager (an approver: prices and budgets are theirs to set), ed an engineer.
GLOBEX_USERS = {"mona": "approver", "ed": "engineer"}
GLOBEX_SHELL = CREATE_USERS.replace('"acme"', '"globex"').format(users=GLOBEX_USERS)
# erin's own key (predict and deploy), as she would have made it on the keys page (journey c
# makes one there): what she starts the A/B plan with, so the request it opens is hers.
ERIN_KEY = """
from tenants.audit import user_actor
from tenants.keys import create_api_key
from tenants.models import Membership
m = Membership.objects.select_related("tenant", "user").get(user__username="erin")
actor = user_actor(m.user, m.role)
print(create_api_key(m.tenant, "erin's laptop", actor, scopes=("predict", "deploy"))[1])
"""
FEATURES = ["a", "b", "c", "d"]
SEED = (
    ("tenant", "acme"),
    ("shell", CREATE_USERS.format(users=USERS)),
    ("weight", "acme", 50),
    ("shell", ERIN_KEY),
    ("tenant", "globex"),
    ("shell", GLOBEX_SHELL),
)
# The guardrails look every second: a step bakes for one and needs 20 requests per arm. Usage is
# rolled up, priced and held against the budgets every 2 s (not every 5 min). A batch job of
# BATCH_ROWS rows runs in chunks of 500, so its page has a rate to show.
ENV = {
    "SWITCHYARD_GUARDRAIL_INTERVAL_S": "1",
    "SWITCHYARD_USAGE_ROLLUP_INTERVAL_S": "2",
    "SWITCHYARD_BATCH_CHUNK_ROWS": "500",
}
BATCH_ROWS = 3000


def sign_in_at(browser, url: str, username: str, path: str):  # noqa: F811
    """Follow a link to ``path`` signed out: the real login page, then ``path`` itself (the
    login's ``next``), without the dashboard in between (sign_in lands there)."""
    context = browser.new_context(base_url=url, viewport=VIEWPORT)
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.goto(path)  # to the login page, which names it as where to go next
    page.fill("#id_username", username)
    page.fill("#id_password", f"pw-{username}-12345")
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}{path}")
    return page


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


def threshold_onnx(threshold: float) -> bytes:
    """A 4 → 2 classifier that answers class 1 when the first feature is above ``threshold``
    (logits 0 and x[0] − threshold): a rule whose right answers the test knows."""
    from onnx import TensorProto, helper, numpy_helper

    weights = np.zeros((4, 2), np.float32)
    weights[0, 1] = 1.0
    bias = np.array([0.0, -threshold], np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
        ],
        "threshold",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(bias, "b")],
    )
    # IR 8: what the installed ONNX Runtime reads (the onnx package writes a newer one).
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return model.SerializeToString()


# Journey (b): model "offers" says whether a customer takes an offer. Last year's rule (v1, in
# production) says yes above 1.0 on the first feature; this quarter's (v2) above -1.0, and the
# customers' answers (the ground truth the labels carry) follow it. Customers now have a first
# feature around 0 (sd 0.5): v1 is wrong on most of them, v2 on none. Judged on online accuracy
# once each arm has 20 labelled rows; the sample cap is far away, so no "no difference" first.
AB_GUARDRAILS = {
    "max_error_rate_increase": 0.05,
    "max_p99_ratio": 50,
    "min_samples": 20,
    "ab_max_samples": 100_000,
}
AB_NEED = 25  # answers per arm the test sends: past min_samples with room to spare


def test_an_ab_plan_is_judged_and_its_winner_applied_under_approval(journey, browser):  # noqa: F811
    from playwright.sync_api import expect

    url, api, backend, procs = journey
    worker = next(p for p in procs if p.name.endswith("worker"))
    created = api.post(
        "/api/v1/models", json={"name": "offers", "task": "classifier", "log_sample_rate": 1.0}
    )
    assert created.status_code == 201, created.text
    upload_and_promote(api, "offers", threshold_onnx(1.0), description="last year's rule")
    files = {"artifact": ("v2.onnx", threshold_onnx(-1.0), "application/octet-stream")}
    v2 = api.post(
        "/api/v1/models/offers/versions", files=files, data={"description": "this quarter's"}
    )
    assert v2.status_code == 201, v2.text
    wait_ready(api, "offers", 60, procs[1])

    # erin starts an A/B test on production with her key: arm a (v1) 40 %, arm b (v2) 60 %.
    # v2 is not approved for production and 60 % is past what the policy lets an unapproved
    # version answer (50 %): the plan starts with arm b at 0 % and the split waits for abe.
    erin_key = backend.shell(ERIN_KEY).split()[-1]
    erin_api = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {erin_key}"}, timeout=30
    )
    arms = [{"name": "a", "version": 1, "weight": 40}, {"name": "b", "version": 2, "weight": 60}]
    started = erin_api.post(
        "/api/v1/models/offers/rollouts",
        json={"mode": "ab", "candidate": 2, "arms": arms, "guardrails": AB_GUARDRAILS},
    )
    assert started.status_code == 202, started.text
    arms_request = started.json()
    assert (arms_request["kind"], arms_request["state"]) == ("arms", "pending"), arms_request
    plan_id = arms_request["plan"]
    approval = f"/approvals/{arms_request['id']}/"

    def plan() -> dict:
        return api.get(f"/api/v1/rollouts/{plan_id}").json()

    assert {a["name"]: a["weight"] for a in plan()["arms"]} == {"a": 40, "b": 0}

    def infer(x: np.ndarray, user: str) -> httpx.Response:
        body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x.tolist()}]}
        answered = api.post("/v2/models/offers/infer", json=body, headers={"X-User-Id": user})
        assert answered.status_code == 200, answered.text
        return answered

    customers = np.random.default_rng(11).normal(0.0, 0.5, size=(2000, 4)).astype(np.float32)
    # Held: every customer still gets v1.
    held = {infer(customers[i], f"customer-{i}").json()["model_version"] for i in range(20)}
    assert held == {"1"}

    # What erin sees: the plan running, arm b at 0 %, her request waiting.
    erin = sign_in_at(browser, url, "erin", f"/rollouts/{plan_id}/")
    legend = erin.locator("[data-split] .legend")
    expect(legend).to_contain_text("a v1 · 40 %")
    expect(legend).to_contain_text("b v2 · 0 %")
    asked_row = erin.locator("#requests tr", has=erin.locator(f'a[href="{approval}"]'))
    expect(asked_row).to_contain_text("Pending")
    expect(asked_row).to_contain_text("A/B arm weights")
    expect(asked_row).to_contain_text("b → 60 %")

    # abe approves the split from his inbox.
    abe = sign_in_at(browser, url, "abe", "/approvals/")
    abe.click(f'#pending a[href="{approval}"]')
    abe.wait_for_url(f"**{approval}")
    expect(abe.locator(".facts").first).to_contain_text("a 40 %, b 60 %")
    abe.fill("#decision-comment", "a fair test; both arms stay under the guardrails")
    abe.click('[data-decision="approve"]')
    expect(abe.locator(".page-head [data-state]")).to_have_text("Applied")

    # The traffic splits (the gateways pick the new weights up within a second), customers
    # answer, and their answers are sent back as feedback: the ground truth, one per request.
    expect(legend).to_contain_text("b v2 · 60 %")
    # v2 is loaded once the plan routes to it (its first answers do not wait on the load).
    wait_until(lambda: api.get("/v2/models/offers/versions/2/ready").status_code == 200, 60)
    served = {"1": 0, "2": 0}
    labels: list[dict] = []
    sent = iter(range(20, len(customers)))

    def serve_until_both_arms_have_enough() -> bool:
        for _ in range(20):
            i = next(sent)
            answered = infer(customers[i], f"customer-{i}")
            served[answered.json()["model_version"]] += 1
            truth = int(customers[i][0] > -1.0)
            labels.append({"request_id": answered.headers["x-request-id"], "label": truth})
        return min(served.values()) >= AB_NEED

    wait_until(serve_until_both_arms_have_enough, 60, procs[0], interval=0)
    assert served["2"] > served["1"], served  # 60 % against 40 %
    fed = api.post("/api/v1/feedback", json={"items": labels})
    assert fed.status_code == 200 and fed.json()["accepted"] == len(labels), fed.text

    # The guardrails judge it: arm b is significantly more accurate, the winner.
    try:
        decided = wait_until(lambda: plan()["ab_result"], 60, worker, interval=0.5)
    except TimeoutError:
        pytest.fail(f"no A/B result: {plan()['status_note']}")
    assert (decided["winner"], decided["metric"]) == ("b", "online accuracy"), decided
    erin.goto(f"/rollouts/{plan_id}/")
    expect(erin.locator("[data-ab-result]")).to_have_text("winner: arm b on online accuracy")
    expect(erin.locator("[data-status-note]")).to_contain_text("arm b won: waiting for approval")
    shot(erin, "journey-ab-result")

    # Applying the winner: arm b is the candidate's, so the guardrails ask for its promotion,
    # as at a canary's last step; abe approves it from his inbox and they carry it out.
    erin_api.close()

    def promotion_asked() -> dict | None:
        pending = api.get("/api/v1/approvals", params={"state": "pending"}).json()
        asked = [p for p in pending if p["kind"] == "promotion" and p["plan"] == plan_id]
        return asked[0] if asked else None

    promotion = wait_until(promotion_asked, 30, worker, interval=0.5)
    assert promotion["requested_by"] == "guardrails" and promotion["to_version"] == 2, promotion
    abe.click("nav >> text=Approvals")
    abe.click(f'#pending a[href="/approvals/{promotion["id"]}/"]')
    abe.wait_for_url(f"**/approvals/{promotion['id']}/")
    abe.fill("#decision-comment", "accuracy won with every arm guarded")
    abe.click('[data-decision="approve"]')
    expect(abe.locator(".page-head [data-state]")).to_have_text(re.compile("Approved|Applied"))
    try:
        wait_until(lambda: plan()["state"] == "promoted", 30, worker, interval=0.5)
    except TimeoutError:
        pytest.fail(f"the approved winner did not land: {plan()['status_note']}")
    erin.goto(f"/rollouts/{plan_id}/")
    expect(erin.locator(".page-head [data-state]")).to_have_text("Promoted")

    # End state: production points at v2 on the model page and every customer gets v2.
    def all_on_v2() -> bool:
        return all(
            infer(customers[i], f"customer-{i}").json()["model_version"] == "2" for i in range(20)
        )

    wait_until(all_on_v2, 15, procs[0], interval=0.2)
    erin.goto("/models/offers/")
    production = erin.locator("table").first.locator("tr", has_text="production")
    expect(production).to_contain_text("v2")
    shot(erin, "journey-ab-winner")
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


def test_a_manager_prices_usage_sets_a_budget_and_a_request_over_it_is_refused(
    journey,
    browser,  # noqa: F811
):
    from playwright.sync_api import expect

    url, api, backend, procs = journey
    key = create_tenant(backend, "globex")
    backend.shell(GLOBEX_SHELL)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as app:
        upload_and_promote(app, "quotes", small_onnx(seed=11))
        wait_ready(app, "quotes", 60, procs[1])
        for _ in range(10):  # ed's service at work, before anything has a price
            assert app.post("/v2/models/quotes/infer", json=BODY).status_code == 200

        # mona, globex's manager, prices what the platform counts for an ONNX model ...
        mona = sign_in_at(browser, url, "mona", "/usage/")
        for resource, price in (("request", "0.01"), ("row", "0.001"), ("cpu_second", "0.5")):
            mona.fill(f'input[data-price="{resource}"]', price)
        mona.click("[data-save-prices]")
        applies = mona.locator('tr[data-resource="request"] td').last
        expect(applies).to_have_text("0.01 USD")  # the page reloaded with them
        # ... and sets a monthly budget of 5 cents with a hard stop.
        mona.fill("#monthly-limit", "0.05")
        mona.fill("#thresholds", "50, 100")
        mona.check("#hard-stop")
        mona.click("[data-save-budget]")
        expect(mona.locator("[data-budget]")).to_contain_text("of 0.05 USD spent this month")

        # The roll-up prices the day's usage (every 2 s here) and finds the budget spent; the
        # gateways refuse globex's requests from then on (429, saying why).
        def refused() -> httpx.Response | None:
            answered = app.post("/v2/models/quotes/infer", json=BODY)
            assert answered.status_code in (200, 429), answered.text
            return answered if answered.status_code == 429 else None

        refusal = wait_until(refused, 60, procs[0], interval=0.5)
        assert "monthly budget of 0.05 USD spent" in refusal.text, refusal.text

    # What mona sees: costs with their currency, the budget spent and the stop explained.
    mona.goto("/usage/")
    expect(mona.locator("[data-total-cost]")).to_have_text(re.compile(r"^\d+\.\d\d USD$"))
    expect(mona.locator("#by-version")).to_contain_text("quotes")
    expect(mona.locator("[data-budget]")).to_contain_text(
        re.compile(r"\d+\.\d\d USD of 0\.05 USD spent this month; alerts at 50, 100 %; hard stop")
    )
    stopped = mona.locator("[data-budget-stopped]")
    expect(stopped).to_have_text("New work is refused: the monthly budget is spent.")
    expect(mona.locator("[data-override-form]")).to_be_visible()  # hers to lift
    shot(mona, "journey-budget")

    # What ed, whose service got the 429, sees: the critical alert saying new work is refused,
    # and on the usage page the same explanation, without the override (mona's to give).
    ed = sign_in_at(browser, url, "ed", "/alerts/")
    alert = ed.locator("#open tr", has_text="100% of the monthly budget spent")
    expect(alert).to_contain_text("of 0.05 USD spent")
    expect(alert).to_contain_text("new work is refused")
    ed.click("nav >> text=Usage")
    expect(ed.locator("[data-budget-stopped]")).to_be_visible()
    expect(ed.locator("[data-override-form]")).to_have_count(0)
    mona.context.close()
    ed.context.close()


def test_a_batch_job_runs_to_completion_with_its_progress(journey, browser):  # noqa: F811
    from playwright.sync_api import expect

    url, api, backend, procs = journey
    worker = next(p for p in procs if p.name.endswith("worker"))
    upload_and_promote(api, "scorer", small_onnx(seed=7), feature_names=json.dumps(FEATURES))
    wait_ready(api, "scorer", 60, procs[1])
    rows = np.random.default_rng(0).standard_normal((BATCH_ROWS, 4)).astype(np.float32)
    lines = [json.dumps(dict(zip(FEATURES, map(float, r), strict=True))) for r in rows]

    # erin submits a file of rows on the jobs page and lands on the job's page.
    erin = sign_in_at(browser, url, "erin", "/jobs/")
    erin.select_option("#j-model", "scorer")
    erin.select_option("#j-format", "jsonl")
    upload = {"name": "rows.jsonl", "mimeType": "application/x-ndjson"}
    erin.set_input_files("#j-file", {**upload, "buffer": "\n".join(lines).encode()})
    erin.click("#job-submit button[type=submit]")
    erin.wait_for_url("**/jobs/*/")
    job_id = int(erin.url.rstrip("/").rsplit("/", 1)[1])

    # The worker runs it a chunk of 500 rows at a time (its log is shown if it does not end).
    def status() -> dict:
        return api.get(f"/api/v1/jobs/{job_id}").json()

    try:
        wait_until(lambda: status()["state"] == "succeeded", 90, worker, interval=0.5)
    except TimeoutError as exc:
        pytest.fail(f"the job did not finish: {status()}\n{exc}")

    # The page follows it to the end: every row answered, 100 %, the rate and the download.
    expect(erin.locator("[data-state]")).to_have_text("succeeded", timeout=15_000)
    expect(erin.locator("[data-rows-done]")).to_have_text(str(BATCH_ROWS))
    expect(erin.locator("[data-rows-failed]")).to_have_text("0")
    expect(erin.locator("[data-percent]")).to_have_text("100 %")
    expect(erin.locator("[data-progress]")).to_have_js_property("value", 100)
    expect(erin.locator("[data-rate]")).to_have_text(re.compile(r"^[\d.]+ rows/s$"))
    expect(erin.locator("[data-output]")).to_be_visible()
    shot(erin, "journey-batch-job")

    # nia, on the same team, finds it done in the jobs list and downloads its output: one
    # answer per row, in order.
    nia = sign_in_at(browser, url, "nia", "/jobs/")
    listed = nia.locator(f'tr[data-job-id="{job_id}"]')
    expect(listed).to_contain_text("succeeded")
    expect(listed).to_contain_text(f"{BATCH_ROWS} / {BATCH_ROWS}")
    listed.locator("a").first.click()
    with nia.expect_download() as download:
        nia.click("[data-output] a")
    answers = [json.loads(line) for line in open(download.value.path())]
    assert [a["row"] for a in answers] == list(range(BATCH_ROWS))
    assert all(len(a["outputs"]["y"]) == 2 for a in answers)
    erin.context.close()
    nia.context.close()
