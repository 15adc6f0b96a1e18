"""Grafana dashboards for the platform, as code: one definition here, written as JSON
(``manage.py grafana_dashboards``) to ``deploy/grafana/dashboards/`` and into the Helm chart,
whose ConfigMaps a Grafana sidecar picks up. Never edited by hand.

Five dashboards: the fleet, one model (traffic, errors and latency by version and arm, batch
occupancy, queue, cold starts), generation (tokens/s, time to first token, inter-token
latency), tenants (usage, budget, throttling) and SLOs (the burn rates the alert rules of
``monitoring.prometheus_rules`` page on). Every query reads metrics ``/metrics`` exports or
those rules record; tests/test_grafana_dashboards.py checks both and parses every query with
promtool. A ``${datasource}`` variable picks the Prometheus; ``tenant``, ``model`` and
``version`` filter (regular expressions, "All" is ``.*``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .prometheus_rules import RATIO
from .slo import ALERT_RULES

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
WIDTH, HEIGHT = 12, 8  # two panels a row on Grafana's 24-column grid

# Filters by the template variables.
T = 'tenant=~"$tenant"'
TM = f'{T}, model=~"$model"'
TMV = f'{TM}, version=~"$version"'


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"  # or "stat", "table"
    thresholds: list[float] = field(default_factory=list)  # drawn as lines (burn rates)
    width: int = WIDTH


@dataclass
class Row:
    title: str
    panels: list[Panel]


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[str, ...]  # of "tenant", "model", "version", in that order
    rows: list[Row]


def rate(metric: str, selector: str = "", by: str = "") -> str:
    """``sum by (...) (rate(metric{selector}[$__rate_interval]))``."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}[{RATE}]))"


def quantile(q: float, histogram: str, selector: str, by: str = "") -> str:
    keep = f"{by}, le" if by else "le"
    return f"histogram_quantile({q:g}, {rate(f'{histogram}_bucket', selector, keep)})"


def quantiles(
    histogram: str, selector: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.95, 0.99)
) -> list[tuple[str, str]]:
    """One query per quantile, its legend the labels kept (``{{version}} {{arm}} p99``)."""
    labels = [f"{{{{{label.strip()}}}}}" for label in by.split(",") if label.strip()]
    return [
        (quantile(q, histogram, selector, by), " ".join([*labels, f"p{q * 100:g}"])) for q in qs
    ]


def error_ratio(selector: str, by: str) -> str:
    errors = rate("switchyard_requests_total", f'{selector}, status=~"5.."', by)
    return f"{errors}\n/ {rate('switchyard_requests_total', selector, by)}"


# Agent metrics come from heartbeats and every web pod exports the same rows: take one.
def agent_gauge(metric: str, by: str = "agent") -> str:
    return f"max by ({by}) ({metric})"


# The agents that hold a version of the chosen model (they report its load time).
ON_MODEL_AGENTS = f"and on (agent) switchyard_model_load_seconds{{{TMV}}}"

FLEET = Dashboard(
    "switchyard-fleet",
    "Switchyard / Fleet",
    "Every model's traffic, the gateways' refusals and dispatch, the agents' queues, memory "
    "and GPUs, and the prediction log.",
    ("tenant",),
    [
        Row(
            "Traffic",
            [
                Panel(
                    "Requests per second by model",
                    [
                        (
                            rate("switchyard_requests_total", T, "tenant, model"),
                            "{{tenant}}/{{model}}",
                        )
                    ],
                    "reqps",
                ),
                Panel(
                    "Server errors (5xx share) by model",
                    [(error_ratio(T, "tenant, model"), "{{tenant}}/{{model}}")],
                    "percentunit",
                ),
                Panel(
                    "Latency, all models",
                    quantiles("switchyard_request_duration_seconds", T),
                    "s",
                    "From the request to the reply in the gateway, any status.",
                ),
                Panel(
                    "Refused requests by reason",
                    [(rate("switchyard_rejected_requests_total", T, "reason"), "{{reason}}")],
                    "reqps",
                    "overload: 503 (queue full, no ready agent, a cold start past its hold); "
                    "rate_limit: 429 (the tenant's rate or a spent budget's hard stop).",
                ),
                Panel(
                    "Dispatch path",
                    [(rate("switchyard_gateway_dispatched_total", "", "path"), "{{path}}")],
                    "ops",
                    "local: on a link this gateway process holds; forwarded: through the "
                    "channel layer; retried: sent again to another replica.",
                ),
                Panel(
                    "Stage time p99, all models",
                    quantiles("switchyard_stage_duration_seconds", T, "stage", (0.99,)),
                    "s",
                    "Sampled: one prediction in SWITCHYARD_STAGE_SAMPLE.",
                ),
            ],
        ),
        Row(
            "Agents",
            [
                Panel(
                    "Queue depth by agent",
                    [(agent_gauge("switchyard_agent_queue_depth"), "{{agent}}")],
                ),
                Panel(
                    "In flight by agent",
                    [(agent_gauge("switchyard_agent_in_flight"), "{{agent}}")],
                ),
                Panel(
                    "Batch occupancy: rows per model run",
                    [
                        (
                            f"{rate('switchyard_agent_batch_size_sum', '', 'agent')}\n"
                            f"/ {rate('switchyard_agent_batch_size_count', '', 'agent')}",
                            "{{agent}}",
                        )
                    ],
                ),
                Panel(
                    "Scheduler drops before compute",
                    [
                        (
                            "sum by (reason) (max by (agent, reason) "
                            f"(rate(switchyard_agent_scheduler_dropped_total[{RATE}])))",
                            "{{reason}}",
                        )
                    ],
                    "reqps",
                    "expired: past their deadline; cancelled: the caller gave up; shed: "
                    "refused or evicted for load.",
                ),
                Panel(
                    "Memory used of budget",
                    [
                        (
                            f"{agent_gauge('switchyard_agent_memory_used_bytes')}\n"
                            f"/ {agent_gauge('switchyard_agent_memory_budget_bytes')}",
                            "{{agent}}",
                        )
                    ],
                    "percentunit",
                ),
                Panel(
                    "GPU utilisation and memory",
                    [
                        (
                            agent_gauge("switchyard_gpu_utilization_ratio", "agent, gpu"),
                            "{{agent}} gpu {{gpu}} busy",
                        ),
                        (
                            f"{agent_gauge('switchyard_gpu_memory_used_bytes', 'agent, gpu')}\n"
                            f"/ {agent_gauge('switchyard_gpu_memory_total_bytes', 'agent, gpu')}",
                            "{{agent}} gpu {{gpu}} memory",
                        ),
                    ],
                    "percentunit",
                ),
            ],
        ),
        Row(
            "Prediction log",
            [
                Panel(
                    "Sampled predictions by outcome",
                    [
                        (
                            rate("switchyard_prediction_log_records_total", "", "outcome"),
                            "{{outcome}}",
                        )
                    ],
                    "ops",
                    "Anything but written is lost: SwitchyardPredictionLogDropping alerts.",
                ),
                Panel(
                    "Batches written again after a database error",
                    [(rate("switchyard_prediction_log_write_retries_total"), "retries")],
                    "ops",
                ),
            ],
        ),
    ],
)

MODEL = Dashboard(
    "switchyard-model",
    "Switchyard / Model",
    "One model: traffic, errors and latency by version and arm, its agents' batches and "
    "queues, and cold starts.",
    ("tenant", "model", "version"),
    [
        Row(
            "Traffic and errors",
            [
                Panel(
                    "Requests per second by version and arm",
                    [
                        (
                            rate("switchyard_requests_total", TMV, "version, arm"),
                            "v{{version}} {{arm}}",
                        )
                    ],
                    "reqps",
                ),
                Panel(
                    "Answers by status",
                    [(rate("switchyard_requests_total", TMV, "status"), "{{status}}")],
                    "reqps",
                ),
                Panel(
                    "Server errors (5xx share) by version and arm",
                    [(error_ratio(TMV, "version, arm"), "v{{version}} {{arm}}")],
                    "percentunit",
                ),
                Panel(
                    "Degraded answers (the fallback ladder answered)",
                    [
                        (
                            rate("switchyard_degraded_answers_total", TMV, "version, step"),
                            "v{{version}} {{step}}",
                        )
                    ],
                    "reqps",
                ),
            ],
        ),
        Row(
            "Latency",
            [
                Panel(
                    "Latency p99 by version and arm",
                    quantiles("switchyard_request_duration_seconds", TMV, "version, arm", (0.99,)),
                    "s",
                ),
                Panel(
                    "Latency p50, p95, p99",
                    quantiles("switchyard_request_duration_seconds", TMV),
                    "s",
                ),
                Panel(
                    "Stage time p99",
                    quantiles("switchyard_stage_duration_seconds", TM, "stage", (0.99,)),
                    "s",
                    "auth, rate_limit, routing, serialization (gateway); dispatch, queue_wait "
                    "and inference (the agent).",
                ),
                Panel(
                    "Graph nodes p99",
                    quantiles("switchyard_graph_node_duration_seconds", TMV, "node", (0.99,)),
                    "s",
                    "Graph versions only.",
                ),
            ],
        ),
        Row(
            "Capacity and cold starts",
            [
                Panel(
                    "Batch occupancy: rows per model run",
                    [
                        (
                            f"(\n  {rate('switchyard_agent_batch_size_sum', '', 'agent')}\n"
                            f"  / {rate('switchyard_agent_batch_size_count', '', 'agent')}\n)\n"
                            f"{ON_MODEL_AGENTS}",
                            "{{agent}}",
                        )
                    ],
                    description="On the agents holding this model (all their versions' runs).",
                ),
                Panel(
                    "Queue depth",
                    [
                        (
                            f"{agent_gauge('switchyard_agent_queue_depth')}\n{ON_MODEL_AGENTS}",
                            "{{agent}}",
                        )
                    ],
                    description="On the agents holding this model.",
                ),
                Panel(
                    "Requests held by a cold start",
                    [
                        (
                            "sum by (outcome) (increase("
                            f"switchyard_cold_start_wait_seconds_count{{{TMV}}}[{RATE}]))",
                            "{{outcome}}",
                        )
                    ],
                    description="ready: a replica came up within the hold; timed_out: refused "
                    "with 503; abandoned: the client left first.",
                ),
                Panel(
                    "Cold-start wait and load time",
                    [
                        (
                            quantile(0.9, "switchyard_cold_start_wait_seconds", TMV),
                            "held request p90",
                        ),
                        (
                            f"max by (agent, version) (switchyard_model_load_seconds{{{TMV}}})",
                            "load v{{version}} on {{agent}}",
                        ),
                    ],
                    "s",
                    "Load: download, load and warm-up of a version on an agent.",
                ),
            ],
        ),
    ],
)

GENERATION = Dashboard(
    "switchyard-generation",
    "Switchyard / Generation",
    "Token generation: tokens per second, time to the first token, time between tokens and "
    "each generation's decode speed.",
    ("tenant", "model", "version"),
    [
        Row(
            "Throughput",
            [
                Panel(
                    "Tokens per second by model and version",
                    [
                        (
                            rate("switchyard_generated_tokens_total", TMV, "model, version"),
                            "{{model}} v{{version}}",
                        )
                    ],
                    "short",
                    "Tokens generated and streamed to clients.",
                ),
                Panel(
                    "Generations per second (first token sent)",
                    [
                        (
                            rate("switchyard_generation_ttft_seconds_count", TMV, "model"),
                            "{{model}}",
                        )
                    ],
                    "ops",
                ),
                Panel(
                    "Decode speed of a generation",
                    quantiles("switchyard_generation_tokens_per_second", TMV, qs=(0.1, 0.5, 0.9)),
                    "short",
                    "Tokens per second after the first, per finished generation: p10 is the "
                    "slowest tenth.",
                ),
            ],
        ),
        Row(
            "Latency",
            [
                Panel(
                    "Time to first token",
                    quantiles("switchyard_generation_ttft_seconds", TMV),
                    "s",
                ),
                Panel(
                    "Time to first token p99 by version",
                    quantiles("switchyard_generation_ttft_seconds", TMV, "version", (0.99,)),
                    "s",
                ),
                Panel(
                    "Inter-token latency",
                    quantiles("switchyard_generation_inter_token_latency_seconds", TMV),
                    "s",
                    "Between tokens as the gateway receives them.",
                ),
            ],
        ),
    ],
)

TENANTS = Dashboard(
    "switchyard-tenants",
    "Switchyard / Tenants",
    "Per tenant: usage, monthly budget and throttling.",
    ("tenant",),
    [
        Row(
            "Usage",
            [
                Panel(
                    "Requests per second by tenant",
                    [(rate("switchyard_requests_total", T, "tenant"), "{{tenant}}")],
                    "reqps",
                ),
                Panel(
                    "Generated tokens per second by tenant",
                    [(rate("switchyard_generated_tokens_total", T, "tenant"), "{{tenant}}")],
                ),
                Panel(
                    "Requests per second by tenant and model",
                    [
                        (
                            rate("switchyard_requests_total", T, "tenant, model"),
                            "{{tenant}}/{{model}}",
                        )
                    ],
                    "reqps",
                ),
                Panel(
                    "Server errors (5xx share) by tenant",
                    [(error_ratio(T, "tenant"), "{{tenant}}")],
                    "percentunit",
                ),
            ],
        ),
        Row(
            "Budget and throttling",
            [
                Panel(
                    "Monthly budget spent",
                    [
                        (
                            f"max by (tenant) (switchyard_tenant_budget_spent{{{T}}})\n"
                            f"/ max by (tenant) (switchyard_tenant_budget_limit{{{T}}})",
                            "{{tenant}}",
                        )
                    ],
                    "percentunit",
                    "This UTC month at the last usage roll-up; a hard stop refuses new work "
                    "past 100 %.",
                    kind="stat",
                ),
                Panel(
                    "Hard stop refusing work",
                    [(f"max by (tenant) (switchyard_tenant_budget_stopped{{{T}}})", "{{tenant}}")],
                    description="1 while the tenant's spent budget refuses new work.",
                    kind="stat",
                ),
                Panel(
                    "Throttled (429) by tenant",
                    [
                        (
                            rate(
                                "switchyard_rejected_requests_total",
                                f'{T}, reason="rate_limit"',
                                "tenant",
                            ),
                            "{{tenant}}",
                        )
                    ],
                    "reqps",
                    "The tenant's request rate, or its budget's hard stop.",
                ),
                Panel(
                    "Refused by tenant and reason",
                    [
                        (
                            rate("switchyard_rejected_requests_total", T, "tenant, reason"),
                            "{{tenant}} {{reason}}",
                        )
                    ],
                    "reqps",
                ),
            ],
        ),
    ],
)


def burn(sli: str, window: str) -> str:
    budget = f'switchyard:slo_error_budget{{{TM}, sli="{sli}"}}'
    return f"{RATIO[sli]}:rate{window}{{{TM}}}\n/ on (tenant, model) {budget}"


def _burn_panels() -> list[Panel]:
    panels = []
    for long, short, threshold, severity in ALERT_RULES:
        for sli in RATIO:
            panels.append(
                Panel(
                    f"{sli.capitalize()} burn rate over {long} and {short} ({severity} "
                    f"above {threshold:g})",
                    [
                        (burn(sli, long), f"{{{{tenant}}}}/{{{{model}}}} {long}"),
                        (burn(sli, short), f"{{{{tenant}}}}/{{{{model}}}} {short}"),
                    ],
                    description="The bad share over the share the objective allows: 1 spends "
                    "the budget exactly over the SLO window. Pages when both windows burn past "
                    "the line (and the long one saw SWITCHYARD_SLO_MIN_EVENTS requests).",
                    thresholds=[threshold],
                )
            )
    return panels


SLOS = Dashboard(
    "switchyard-slos",
    "Switchyard / SLOs",
    "Each model's objectives, its SLIs and the burn rates the multi-window alerts page on.",
    ("tenant", "model"),
    [
        Row(
            "Objectives and alerts",
            [
                Panel(
                    "Objectives",
                    [(f"switchyard:slo_objective{{{TM}}}", "")],
                    "percentunit",
                    "Model.slo_*: le is the latency bucket within the model's threshold.",
                    kind="table",
                ),
                Panel(
                    "SLO alerts firing",
                    [
                        (
                            'ALERTS{alertname=~"Switchyard.*BudgetBurn.*", alertstate="firing", '
                            f"{TM}}}",
                            "",
                        )
                    ],
                    kind="table",
                ),
                Panel(
                    "Availability over 1 h (1 - 5xx share)",
                    [(f"1 - switchyard:error_ratio:rate1h{{{TM}}}", "{{tenant}}/{{model}}")],
                    "percentunit",
                ),
                Panel(
                    "Within the latency threshold over 1 h",
                    [(f"1 - switchyard:slow_ratio:rate1h{{{TM}}}", "{{tenant}}/{{model}}")],
                    "percentunit",
                ),
            ],
        ),
        Row("Burn rates", _burn_panels()),
    ],
)

DASHBOARDS = (FLEET, MODEL, GENERATION, TENANTS, SLOS)


# JSON --------------------------------------------------------------------------------------


def _variable(name: str, previous: list[str]) -> dict[str, Any]:
    # Each variable's values are narrowed by the ones before it (tenant, then model).
    narrowed = ", ".join(f'{p}=~"${p}"' for p in previous)
    return {
        "type": "query",
        "name": name,
        "label": name.capitalize(),
        "datasource": DATASOURCE,
        "query": {
            "query": f"label_values(switchyard_requests_total{{{narrowed}}}, {name})",
            "refId": f"{name}-values",
        },
        "definition": f"label_values(switchyard_requests_total{{{narrowed}}}, {name})",
        "refresh": 2,  # when the time range changes
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def _templating(dashboard: Dashboard) -> dict[str, Any]:
    variables: list[dict[str, Any]] = [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Data source",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        }
    ]
    for i, name in enumerate(dashboard.variables):
        variables.append(_variable(name, list(dashboard.variables[:i])))
    return {"list": variables}


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    if panel.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10}
        defaults["custom"]["showPoints"] = "never"
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    for value in panel.thresholds:
        steps.append({"color": "red", "value": value})
    defaults["thresholds"] = {"mode": "absolute", "steps": steps}
    if panel.thresholds:
        defaults["custom"]["thresholdsStyle"] = {"mode": "line"}
    instant = panel.kind != "timeseries"
    out: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": HEIGHT, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
                "range": not instant,
                "instant": instant,
                **({"format": "table"} if panel.kind == "table" else {}),
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }
    if panel.kind == "timeseries":
        out["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return out


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for row in dashboard.rows:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        x = 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + HEIGHT
            panels.append(_panel(panel, next_id, x, y))
            next_id += 1
            x += panel.width
        y += HEIGHT
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["switchyard"],
        "timezone": "utc",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,  # a shared crosshair
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": _templating(dashboard),
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "type": "dashboards",
                "tags": ["switchyard"],
                "asDropdown": True,
                "title": "Switchyard",
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "panels": panels,
    }


def file_name(dashboard: Dashboard) -> str:
    return dashboard.uid.removeprefix("switchyard-") + ".json"


def render_all() -> dict[str, str]:
    """{file name: JSON text} of every dashboard."""
    return {
        file_name(d): json.dumps(dashboard_json(d), indent=2, ensure_ascii=False) + "\n"
        for d in DASHBOARDS
    }


def expressions(board: dict[str, Any]) -> list[str]:
    """Every PromQL query of a dashboard's JSON, variables' queries excluded."""
    return [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
