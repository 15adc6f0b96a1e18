"""The shipped alert rules against a live platform: Debian's prometheus scrapes the platform's
/metrics every second and evaluates the rules ``manage.py prometheus_rules`` writes (the burn
windows shrunk from 1 h / 5 m to 30 s / 10 s, the rules' shape unchanged); a model whose version
fails burns its availability budget until the fast burn alert fires, and a healthy model
beside it alerts on nothing. Every Grafana dashboard query then runs on that Prometheus."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.onnx_models import poisoned_onnx, small_onnx
from tests.test_grafana_dashboards import boards, concrete, queries

from .conftest import platform_with_agent, upload_and_promote, wait_ready
from .harness import (
    METRICS_TOKEN,
    Proc,
    create_tenant,
    free_port,
    services_available,
    wait_until,
)

pytestmark = pytest.mark.e2e

PROMETHEUS = shutil.which("prometheus")
# Burn windows short enough for a test, in the order of the real ones (5m < 30m < 1h < 6h).
WINDOWS = ("5m=10s", "30m=20s", "1h=30s", "6h=1m")
MIN_EVENTS = 20
POISON = 1000.0  # poisoned_onnx raises on rows over its threshold (100): a server error


def body(value: float) -> dict:
    return {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4}]}


def start_prometheus(tmp: Path, target: str, rules: Path) -> tuple[Proc, str]:
    token = tmp / "metrics-token"
    token.write_text(METRICS_TOKEN)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": "switchyard",
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials_file": str(token)},
                "static_configs": [{"targets": [target]}],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    args = [
        str(PROMETHEUS),
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    proc = Proc("prometheus", args, {"PATH": "/usr/bin:/bin"}, tmp, cwd=tmp)
    url = f"http://127.0.0.1:{port}"

    def scraped() -> bool:
        try:
            targets = httpx.get(f"{url}/api/v1/targets", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        return any(t["health"] == "up" for t in targets["data"]["activeTargets"])

    wait_until(scraped, 60, proc, interval=0.5)
    return proc, url


def firing(prometheus: str) -> list[dict]:
    alerts = httpx.get(f"{prometheus}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return [a for a in alerts if a["state"] == "firing"]


def query(prometheus: str, expr: str) -> list[dict]:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (.ci/run installs it)")
def test_a_failing_model_fires_the_fast_burn_alert_and_a_healthy_one_does_not(tmp_path):
    backend_name = "services" if services_available() else "embedded"
    seed = (("tenant", "alpha"),)  # platform_with_agent adds its node
    with platform_with_agent(backend_name, tmp_path, seed=seed) as (backend, url, _):
        key = create_tenant(backend, "alpha")
        rules = tmp_path / "rules.yml"
        args = ["--out", str(rules), "--min-events", str(MIN_EVENTS)]
        backend.manage("prometheus_rules", *args, *(a for w in WINDOWS for a in ("--window", w)))
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            upload_and_promote(client, "flaky", poisoned_onnx())
            upload_and_promote(client, "steady", small_onnx())
            wait_ready(client, "flaky")
            wait_ready(client, "steady")
            prom_dir = tmp_path / "prometheus"
            prom_dir.mkdir()
            prometheus, prom_url = start_prometheus(prom_dir, url.removeprefix("http://"), rules)
            try:
                fired = drive_until_burning(client, prom_url)
                check_dashboards(prom_url)
                # Each model's objective came from the platform's database via /metrics.
                objectives = query(prom_url, 'switchyard:slo_objective{sli="availability"}')
                assert {o["metric"]["model"]: float(o["value"][1]) for o in objectives} == {
                    "flaky": 0.999,
                    "steady": 0.999,
                }
            finally:
                prometheus.stop()
    (alert,) = [a for a in fired if a["labels"]["alertname"] == "SwitchyardErrorBudgetBurnFast"]
    assert alert["labels"] == {
        "alertname": "SwitchyardErrorBudgetBurnFast",
        "tenant": "alpha",
        "model": "flaky",
        "severity": "critical",
        "slo": "availability",
    }
    assert "alpha/flaky burns its availability error budget" in alert["annotations"]["summary"]
    assert not [a for a in fired if a["labels"].get("model") == "steady"], fired


def check_dashboards(prometheus: str) -> None:
    """Every dashboard query runs on the live Prometheus; the SLO dashboard's fast burn rate
    shows flaky burning past the alert's rate."""
    for board in boards().values():
        for expr in queries(board):
            query(prometheus, concrete(expr))
    slos = boards()["slos.json"]
    (fast,) = [p for p in slos["panels"] if p["title"].startswith("Availability burn rate over 1h")]
    burning = query(prometheus, concrete(fast["targets"][0]["expr"]))
    rates = {series["metric"]["model"]: float(series["value"][1]) for series in burning}
    assert rates["flaky"] > 14.4 and rates.get("steady", 0.0) == 0.0, rates
    # The latency objective's le names a bucket the live histogram has: without the match the
    # slow ratio would have no series at all.
    slow = query(prometheus, 'switchyard:slow_ratio:rate1h{model="steady"}')
    assert len(slow) == 1 and 0.0 <= float(slow[0]["value"][1]) < 1.0, slow


def drive_until_burning(client: httpx.Client, prometheus: str) -> list[dict]:
    """Half of flaky's requests fail, all of steady's succeed, until the fast burn alert fires
    (at most 90 s and 6,000 requests); returns the firing alerts then."""
    deadline = time.monotonic() + 90
    statuses: dict[int, int] = {}
    for sent in range(6000):
        for value in (POISON, 1.0):
            status = client.post("/v2/models/flaky/infer", json=body(value)).status_code
            statuses[status] = statuses.get(status, 0) + 1
        assert client.post("/v2/models/steady/infer", json=body(1.0)).status_code == 200
        if sent % 20 == 0:
            alerts = firing(prometheus)
            names = {a["labels"]["alertname"] for a in alerts}
            if "SwitchyardErrorBudgetBurnFast" in names:
                assert any(s >= 500 for s in statuses), statuses
                took = 90 - (deadline - time.monotonic())
                print(
                    f"fast burn alert firing after {took:.1f} s, {sum(statuses.values())} "
                    f"requests to flaky: {statuses}"
                )
                return alerts
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)  # a steady trickle: the short windows need samples spread over time
    ratio = query(prometheus, "switchyard:error_ratio:rate1h")
    raise AssertionError(f"no burn alert: statuses {statuses}, error ratios {ratio}")
