"""deploy/prometheus/: the scrape config and rules pass promtool's checks, the burn-rate alerts
pass their unit tests, the checked-in rules are what monitoring/prometheus_rules.py generates,
every metric the rules use is one the platform exports, and /metrics exports each model's
objectives in the shape the rules join against."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from gateway import metrics, predlog, tracing
from monitoring import prometheus_rules
from monitoring.models import Budget
from monitoring.slo import BURN_WINDOWS
from tests.factories import make_model

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
# The rules ship twice: for a Prometheus of one's own, and in the Helm chart's PrometheusRule
# (helm reads no file outside the chart's folder).
SHIPPED = (
    PROMETHEUS / "alerts.yml",
    ROOT / "deploy" / "helm" / "switchyard" / "rules" / "alerts.yml",
)
REGENERATE = (
    "python manage.py prometheus_rules --out deploy/prometheus/alerts.yml "
    "--out deploy/helm/switchyard/rules/alerts.yml"
)
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


def exported_families() -> str:
    """The exposition, with every family the platform defines present (a family whose
    collector found no rows still writes its TYPE line)."""
    assert predlog.PredictionLogger  # its counter is defined where the server imports it
    pending = metrics.RequestMetrics()
    pending.record(metrics.Observed(tracing.start_trace(None, None)), 429, 0.01)
    pending.fold()
    return metrics.exposition().decode()


@pytest.mark.django_db
def test_every_metric_the_rules_use_is_exported():
    exported = exported_families()
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


@pytest.mark.django_db
def test_the_shipped_rules_are_what_the_generator_writes(settings):
    # The embedded defaults: what an install gets unless it sets these.
    settings.SWITCHYARD_SLO_MIN_EVENTS = 100
    settings.SWITCHYARD_SLO_WINDOW_DAYS = 30
    want = prometheus_rules.render()
    for path in SHIPPED:
        assert path.read_text() == want, f"{path} is stale; regenerate it: {REGENERATE}"


def test_every_burn_alert_uses_the_windows_and_rates_of_slo_py():
    groups = {g["name"]: g["rules"] for g in prometheus_rules.rule_groups(events=100)["groups"]}
    alerts = {rule["alert"]: rule for rule in groups["switchyard-slo"] if "alert" in rule}
    fast = alerts["SwitchyardErrorBudgetBurnFast"]["expr"]
    assert "switchyard:error_ratio:rate1h > on (tenant, model) (14.4 *" in fast
    assert "switchyard:error_ratio:rate5m > on (tenant, model) (14.4 *" in fast
    assert "switchyard:requests:rate1h * 3600 >= 100" in fast
    slow = alerts["SwitchyardLatencyBudgetBurn"]["expr"]
    assert "switchyard:slow_ratio:rate6h > on (tenant, model) (6 *" in slow
    assert "switchyard:slow_ratio:rate30m" in slow
    assert {rule["labels"]["severity"] for rule in alerts.values()} == {"critical", "warning"}


def test_shrunk_windows_change_only_the_durations():
    """The live test shrinks the windows (an hour to a minute); its rules must be these rules."""
    short = {"5m": "10s", "30m": "40s", "1h": "1m", "6h": "2m"}
    windows = {name: timedelta(seconds=_seconds(v)) for name, v in short.items()}
    normal = prometheus_rules.rule_groups(events=100)["groups"]
    shrunk = prometheus_rules.rule_groups(windows, events=100)["groups"]
    assert [g["name"] for g in normal] == [g["name"] for g in shrunk]
    for before, after in zip(normal, shrunk, strict=True):
        if before["name"] == "switchyard-operations":  # not SLO windows: untouched
            assert before == after
            continue
        for rule, small in zip(before["rules"], after["rules"], strict=True):
            expr = rule["expr"]
            for name in BURN_WINDOWS:
                expr = expr.replace(f"[{name}]", f"[{short[name]}]")
            # The event minimum counts the long window's seconds.
            expr = expr.replace("* 3600 >=", "* 60 >=").replace("* 21600 >=", "* 120 >=")
            assert small["expr"] == expr
            assert {k: v for k, v in small.items() if k not in ("expr", "annotations")} == {
                k: v for k, v in rule.items() if k not in ("expr", "annotations")
            }


def _seconds(text: str) -> int:
    return int(text[:-1]) * {"s": 1, "m": 60, "h": 3600}[text[-1]]


def test_a_window_must_be_whole_seconds_and_named():
    assert prometheus_rules.duration(timedelta(hours=1, minutes=30)) == "1h30m"
    assert prometheus_rules.duration(timedelta(days=3)) == "3d"
    with pytest.raises(ValueError):
        prometheus_rules.duration(timedelta(milliseconds=1500))
    with pytest.raises(ValueError):
        prometheus_rules.rule_groups({"2h": timedelta(hours=2)}, events=1)


@pytest.mark.django_db
def test_the_command_writes_the_rules_with_shrunk_windows(tmp_path):
    out = tmp_path / "rules.yml"
    call_command("prometheus_rules", "--out", str(out), "--window", "1h=1m", "--min-events", "5")
    text = out.read_text()
    assert text == prometheus_rules.render({"1h": timedelta(minutes=1)}, events=5)
    assert "[1m]" in text and "[1h]" not in text and "* 60 >= 5" in text
    for bad in ("2h=1m", "1h=0s", "1h=1x", "1h"):
        with pytest.raises(CommandError, match="NAME=LENGTH"):
            call_command("prometheus_rules", "--window", bad)


@needs_promtool
@pytest.mark.django_db
def test_shrunk_rules_pass_promtool(tmp_path):
    out = tmp_path / "rules.yml"
    call_command("prometheus_rules", "--out", str(out), "--window", "5m=10s", "--window", "1h=1m")
    assert "SUCCESS" in run_promtool("check", "rules", str(out))


def objective_samples() -> dict[tuple[str, str, str], tuple[str, float]]:
    """{(tenant, model, sli): (le, objective)} from one exposition."""
    found = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        if family.name == "switchyard_slo_objective":
            for s in family.samples:
                key = (s.labels["tenant"], s.labels["model"], s.labels["sli"])
                found[key] = (s.labels.get("le", ""), s.value)
    return found


@pytest.mark.django_db
def test_each_models_objectives_are_exported_with_the_bucket_its_threshold_names(world):
    make_model(world.a, "fraud")  # the defaults: 99.9 %, and 99 % within 100 ms
    ranker = make_model(world.b, "ranker")
    ranker.slo_availability, ranker.slo_latency_ms, ranker.slo_latency_target = 0.99, 150, 0.95
    ranker.save()
    tiny = make_model(world.b, "tiny")
    tiny.slo_latency_ms = 0.5
    tiny.save()
    found = objective_samples()
    assert found[("alpha", "fraud", "availability")] == ("", 0.999)
    assert found[("alpha", "fraud", "latency")] == ("0.1", 0.99)
    assert found[("beta", "ranker", "availability")] == ("", 0.99)
    # 150 ms lies inside the (0.1, 0.25] bucket: only requests within 100 ms surely met it.
    assert found[("beta", "ranker", "latency")] == ("0.1", 0.95)
    assert found[("beta", "tiny", "latency")] == ("0.0005", 0.99)
    # The le values name buckets the latency histogram really has.
    pending = metrics.RequestMetrics()
    observed = metrics.Observed(tracing.start_trace(None, None))
    pending.record(observed, 200, 0.01)
    pending.fold()
    text = metrics.exposition().decode()
    for le, _ in found.values():
        if le:
            assert f'le="{le}"' in text, le


@pytest.mark.django_db
def test_budgets_are_exported_per_tenant(world):
    Budget.objects.create(
        tenant=world.a, monthly_limit=250, spent=300, hard_stop=True, stopped=True
    )
    # beta's stop is overridden by an approver for an hour: its work is not refused.
    Budget.objects.create(
        tenant=world.b,
        monthly_limit=10,
        currency="EUR",
        spent=12,
        hard_stop=True,
        stopped=True,
        override_until=timezone.now() + timedelta(hours=1),
    )
    exported = {
        (s.name, s.labels.get("tenant")): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
        if s.name.startswith("switchyard_tenant_budget")
    }
    assert exported[("switchyard_tenant_budget_limit", "alpha")] == 250
    assert exported[("switchyard_tenant_budget_spent", "alpha")] == 300
    assert exported[("switchyard_tenant_budget_stopped", "alpha")] == 1
    assert exported[("switchyard_tenant_budget_limit", "beta")] == 10
    assert exported[("switchyard_tenant_budget_stopped", "beta")] == 0
