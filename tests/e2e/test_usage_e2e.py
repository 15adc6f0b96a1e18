"""Usage and budgets with real processes (uvicorn, a serving agent, PostgreSQL + Redis or the
embedded default): a known number of requests, rows and generated tokens is served, the roll-up
makes ``UsageDay`` rows that equal exactly what was answered, with the agent's measured
CPU-seconds, priced as units x the default prices; then a hard budget below the spend refuses
new work with a 429 naming the budget, and an approver's override lifts it."""

from __future__ import annotations

import json
import time
from decimal import Decimal

import httpx
import pytest

from tests.onnx_models import small_onnx

from .conftest import BACKENDS, platform_with_agent, upload_and_promote, wait_ready
from .harness import create_tenant, wait_until
from .test_streaming_e2e import textgen_artifact

pytestmark = pytest.mark.e2e

REQUESTS, ROWS_EACH = 12, 3
GENERATIONS, MAX_TOKENS = 3, 5
PRICES = {
    "request": "0.01",
    "row": "0.001",
    "token_in": "0.0001",
    "token_out": "0.0002",
    "cpu_second": "0.5",
}
TINY_TEXTGEN = {"context": 64, "n_layer": 1, "n_head": 1, "n_embd": 16}


def oip_body(rows: int) -> dict:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": [0.5] * rows * 4}]
    }


def usage_rows(backend) -> list[tuple]:
    return backend.query(
        "SELECT m.name, u.requests, u.rows, u.tokens_in, u.tokens_out, u.cpu_s, u.cost "
        "FROM monitoring_usageday u JOIN registry_model m ON m.id = u.model_id ORDER BY m.name"
    )


def counted(backend) -> tuple[int, int, int, int]:
    (row,) = backend.query(
        "SELECT COALESCE(SUM(requests), 0), COALESCE(SUM(rows), 0), "
        "COALESCE(SUM(tokens_in), 0), COALESCE(SUM(tokens_out), 0) FROM gateway_trafficsample"
    )
    return tuple(int(v) for v in row)


def compute_seconds(backend) -> float:
    (row,) = backend.query("SELECT COALESCE(SUM(cpu_s), 0) FROM monitoring_computeday")
    return float(row[0])


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_usage_equals_what_was_served_and_a_hard_budget_stops_and_is_overridden(
    backend_name, tmp_path
):
    env = {"SWITCHYARD_AGENT_HEARTBEAT_S": "0.5", "SWITCHYARD_BUDGET_REFRESH_S": "0.5"}
    with platform_with_agent(backend_name, tmp_path, env, seed=(("tenant", "metered"),)) as (
        backend,
        url,
        procs,
    ):
        key = create_tenant(backend, "metered")
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as api:
            upload_and_promote(api, "clf", small_onnx())
            created = api.post("/api/v1/models", json={"name": "writer", "task": "generator"})
            assert created.status_code == 201, created.text
            files = {"artifact": ("w.safetensors", textgen_artifact(**TINY_TEXTGEN), "x/y")}
            fields = {"format": "textgen", "max_input_tokens": "32", "max_output_tokens": "16"}
            assert api.post("/api/v1/models/writer/versions", files=files, data=fields).is_success
            api.put("/api/v1/models/writer/aliases/production", json={"version": 1})
            wait_ready(api, "clf", timeout=60, proc=procs[1])
            wait_ready(api, "writer", timeout=60, proc=procs[1])
            time.sleep(1.5)  # the session's first heartbeats: the compute baseline

            for _ in range(REQUESTS):
                answered = api.post("/v2/models/clf/infer", json=oip_body(ROWS_EACH))
                assert answered.status_code == 200, answered.text
            tokens_in = tokens_out = 0
            for i in range(GENERATIONS):
                body = {"model": "writer", "prompt": f"usage {i}", "max_tokens": MAX_TOKENS}
                done = api.post("/v1/completions", json=body)
                assert done.status_code == 200, done.text
                tokens_in += done.json()["usage"]["prompt_tokens"]
                tokens_out += done.json()["usage"]["completion_tokens"]
            assert tokens_in > 0 and tokens_out > 0

            # The gateway flushes its counts every 5 s; the agent's next heartbeats carry the
            # runs' compute.
            expected = (REQUESTS + GENERATIONS, REQUESTS * ROWS_EACH, tokens_in, tokens_out)
            wait_until(lambda: counted(backend) == expected, 30, procs[0])
            wait_until(lambda: compute_seconds(backend) > 0, 30, procs[0])
            time.sleep(1.0)  # a heartbeat after the last run

            prices = json.dumps(PRICES)
            backend.shell(
                "from monitoring import usage; from tenants.audit import Actor; "
                f"usage.set_prices(None, {prices}, Actor(None, 'operator')); usage.roll_up()"
            )
            rows = {name: rest for name, *rest in usage_rows(backend)}
            requests, row_count, t_in, t_out, cpu_s, cost = rows["clf"]
            assert (requests, row_count, t_in, t_out) == (REQUESTS, REQUESTS * ROWS_EACH, 0, 0)
            assert cpu_s > 0
            price = {k: Decimal(v) for k, v in PRICES.items()}
            want = (
                REQUESTS * price["request"]
                + REQUESTS * ROWS_EACH * price["row"]
                + Decimal(repr(round(cpu_s, 6))) * price["cpu_second"]
            ).quantize(Decimal("0.000001"))
            assert Decimal(str(cost)).quantize(Decimal("0.000001")) == want
            w_requests, _, w_in, w_out, w_cpu, w_cost = rows["writer"]
            assert (w_requests, w_in, w_out) == (GENERATIONS, tokens_in, tokens_out)
            assert w_cpu > 0
            w_want = (
                GENERATIONS * price["request"]
                + tokens_in * price["token_in"]
                + tokens_out * price["token_out"]
                + Decimal(repr(round(w_cpu, 6))) * price["cpu_second"]
            ).quantize(Decimal("0.000001"))
            assert Decimal(str(w_cost)).quantize(Decimal("0.000001")) == w_want

            # A hard budget below the spend: new work is refused, naming the budget.
            backend.shell(
                "from monitoring import budgets; from tenants.models import Tenant; "
                "from tenants.audit import Actor; "
                "t = Tenant.objects.get(slug='metered'); "
                "budgets.set_budget(t.pk, {'monthly_limit': '0.01', 'hard_stop': True}, "
                "Actor(None, 'approver', 'approver'))"
            )

            def refused() -> bool:
                return api.post("/v2/models/clf/infer", json=oip_body(1)).status_code == 429

            wait_until(refused, 10, procs[0])
            stopped = api.post("/v2/models/clf/infer", json=oip_body(1))
            assert "monthly budget of 0.01 USD spent" in stopped.json()["error"]
            assert "an approver can override" in stopped.json()["error"]
            generation = api.post(
                "/v1/completions", json={"model": "writer", "prompt": "x", "max_tokens": 2}
            )
            assert generation.status_code == 429
            assert "monthly budget" in generation.json()["error"]["message"]

            backend.shell(
                "from datetime import timedelta; from django.utils import timezone; "
                "from monitoring import budgets; from tenants.models import Tenant; "
                "from tenants.audit import Actor; "
                "t = Tenant.objects.get(slug='metered'); "
                "end = min(budgets.month_end(timezone.now()), "
                "timezone.now() + timedelta(hours=1)); "
                "budgets.override(t.pk, Actor(None, 'approver', 'approver'), 'e2e', end)"
            )
            wait_until(lambda: not refused(), 10, procs[0])
