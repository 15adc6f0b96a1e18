"""deploy/prometheus/: the scrape config and rules pass promtool's checks, the burn-rate alerts
pass their unit tests, and every metric the rules use is one the platform exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway import metrics, predlog, tracing

PROMETHEUS = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not installed (.ci/run installs Debian's prometheus)"
)


def run_promtool(*args: str, cwd: Path = PROMETHEUS) -> str:
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@needs_promtool
def test_scrape_config_and_rules_are_valid(tmp_path):
    # promtool checks that the scrape token's file exists: a copy of the layout, with one.
    copy = tmp_path / "deploy" / "prometheus"
    shutil.copytree(PROMETHEUS, copy)
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "metrics-token").write_text("a-token\n")
    assert "SUCCESS" in run_promtool("check", "config", "prometheus.yml", cwd=copy)
    assert "SUCCESS" in run_promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_burn_rate_alerts_fire_on_fast_burns_and_not_on_healthy_traffic():
    assert "SUCCESS" in run_promtool("test", "rules", "alerts_test.yml")


def test_kubernetes_config_differs_only_in_how_targets_are_found():
    local = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    kube = yaml.safe_load((PROMETHEUS / "prometheus-kubernetes.yml").read_text())
    assert {k: v for k, v in local.items() if k != "scrape_configs"} == {
        k: v for k, v in kube.items() if k != "scrape_configs"
    }
    (job,) = kube["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["kubernetes_sd_configs"][0]["role"] == "pod"


@pytest.mark.django_db
def test_every_metric_the_rules_use_is_exported():
    assert predlog.PredictionLogger  # its counter is defined where the server imports it
    pending = metrics.RequestMetrics()
    pending.record(metrics.Observed(tracing.start_trace(None, None)), 429, 0.01)
    pending.fold()
    exported = metrics.exposition().decode()
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    used = {
        name
        for group in rules["groups"]
        for rule in group["rules"]
        for name in re.findall(r"\b(switchyard_[a-z_]+)", rule["expr"])
    }
    assert used  # the regex found the rules' metrics
    for name in sorted(used):
        family = re.sub(r"_(bucket|count|sum)$", "", name)
        assert f"# TYPE {family} " in exported or f"# TYPE {name} " in exported, name


def test_both_scrape_configs_send_the_metrics_token():
    # /metrics answers 401 without it (gateway/scrape.py).
    for name, token_file in (
        ("prometheus.yml", "../../var/metrics-token"),
        ("prometheus-kubernetes.yml", "/etc/prometheus/switchyard-metrics-token"),
    ):
        (job,) = yaml.safe_load((PROMETHEUS / name).read_text())["scrape_configs"]
        assert job["authorization"] == {"type": "Bearer", "credentials_file": token_file}, name
