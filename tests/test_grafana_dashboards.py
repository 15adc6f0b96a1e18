"""The Grafana dashboards (monitoring/dashboards.py): the checked-in JSON is the generator's
output, every query parses (promtool) and reads only metrics /metrics exports or the generated
rules record, and each dashboard has the shape Grafana's provisioning and sidecar expect."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from monitoring import dashboards, prometheus_rules
from monitoring.slo import ALERT_RULES
from tests.test_prometheus_rules import exported_families

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = (
    ROOT / "deploy" / "grafana" / "dashboards",
    ROOT / "deploy" / "helm" / "switchyard" / "dashboards",
)
REGENERATE = (
    "python manage.py grafana_dashboards --out deploy/grafana/dashboards "
    "--out deploy/helm/switchyard/dashboards"
)
# What Grafana puts in for the variables, for checking the queries outside Grafana.
VARIABLES = {"$__rate_interval": "1m", "$tenant": ".*", "$model": ".*", "$version": ".*"}
NAME = re.compile(r"\b(switchyard(?:_[a-z0-9]+)+|switchyard:[a-z0-9_:]+)\b")


def boards() -> dict[str, dict]:
    return {name: json.loads(text) for name, text in dashboards.render_all().items()}


def queries(board: dict) -> list[str]:
    """The panels' queries and the variables' label_values selectors."""
    found = dashboards.expressions(board)
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            selector = re.fullmatch(r"label_values\((.*), \w+\)", variable["definition"])
            assert selector, variable["definition"]
            found.append(selector[1])
    return found


def concrete(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr  # a variable the check would not fill in
    return expr


def test_the_shipped_dashboards_are_what_the_generator_writes():
    want = dashboards.render_all()
    assert set(want) == {"fleet.json", "model.json", "generation.json", "tenants.json", "slos.json"}
    for folder in FOLDERS:
        have = {p.name: p.read_text() for p in folder.glob("*.json")}
        assert have == want, f"{folder} is stale; regenerate it: {REGENERATE}"


@pytest.mark.django_db
def test_every_metric_a_dashboard_reads_is_exported_or_recorded():
    exported = set(re.findall(r"^# TYPE (\S+) ", exported_families(), re.MULTILINE))
    groups = prometheus_rules.rule_groups()["groups"]
    recorded = {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}
    for name, board in boards().items():
        used = {n for q in queries(board) for n in NAME.findall(q)}
        assert used, name
        for metric in sorted(used):
            family = re.sub(r"_(bucket|count|sum|total)$", "", metric)
            known = {metric, family, f"{family}_total"} & (exported | recorded)
            assert known, f"{name} reads {metric}, which nothing exports or records"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_every_query_parses(tmp_path):
    # promtool parses each expression of a rules file: every query as a recording rule.
    rules = [
        {"record": f"check:{name.removesuffix('.json')}:{i}", "expr": concrete(expr)}
        for name, board in boards().items()
        for i, expr in enumerate(queries(board))
    ]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def test_each_dashboard_picks_its_prometheus_and_filters_by_its_variables():
    uids = set()
    for name, board in boards().items():
        assert board["schemaVersion"] == 39 and board["uid"] not in uids, name
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            for target in panel["targets"]:
                # A query that names a variable the dashboard lacks would stay unfilled.
                for var in re.findall(r"\$(tenant|model|version)\b", target["expr"]):
                    assert var in variables, (name, panel["title"], var)
    model = {
        v["name"] for v in json.loads(dashboards.render_all()["model.json"])["templating"]["list"]
    }
    assert model == {"datasource", "tenant", "model", "version"}


def test_panels_do_not_overlap():
    for name, board in boards().items():
        taken: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24, (name, panel["title"])
            cells = {
                (x, y)
                for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])
            }
            assert not cells & taken, (name, panel["title"])
            taken |= cells


def test_the_slo_dashboard_draws_each_alert_rules_burn_threshold():
    slos = boards()["slos.json"]
    lines = {
        step["value"]
        for panel in slos["panels"]
        if panel["type"] == "timeseries"
        for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
        if step["value"] is not None
    }
    assert lines == {rate for _, _, rate, _ in ALERT_RULES}
