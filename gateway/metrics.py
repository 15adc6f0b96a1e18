"""Prometheus metrics of the data path and the fleet, served at ``/metrics``.

Request metrics are counted per process in plain dicts (well under a microsecond per request)
and folded into prometheus-client's metrics by the gateway's refresh loop every
``REFRESH_INTERVAL_S`` and before each scrape. Observing each request straight into
prometheus-client costs 2.6-4.3 us per observation in multiprocess mode (measured: an mmap
write under a lock), ~25 us for the eight a request makes, which is ~10 % of a warm request.

Several server processes: set ``PROMETHEUS_MULTIPROC_DIR`` (an empty directory, wiped when
the server starts) for every process; a scrape of any of them then sums all of them. Agent
metrics (queue depth, in flight, batch sizes, load times, memory, GPU) come from the agents'
latest heartbeats in the database, read at scrape time, so every process reports the same; so
do the models' SLO objectives and the tenants' budgets (``PlatformCollector``).
"""

from __future__ import annotations

import bisect
import math
import os
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

from fleet.nodes import live_sessions
from monitoring.budgets import budget_figures
from monitoring.prometheus_rules import model_objectives
from registry.models import ModelVersion
from serving_agent.protocol import BATCH_SIZE_BOUNDS

from .routes import Route
from .tracing import Trace

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STAGE_BUCKETS_S: tuple[float, ...]  # the fine buckets, then the coarse ones
STAGE_BUCKETS_S = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025)
STAGE_BUCKETS_S += (0.05, 0.1, 0.25, 1, 5)
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
ITL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

REQUESTS = Counter(
    "switchyard_requests",
    "Prediction requests answered, by tenant, model, version, arm and HTTP status.",
    ["tenant", "model", "version", "arm", "status"],
)
LATENCY = Histogram(
    "switchyard_request_duration_seconds",
    "Prediction latency in the gateway, from the request to the reply (any status).",
    ["tenant", "model", "version", "arm"],
    buckets=LATENCY_BUCKETS_S,
)
STAGES = Histogram(
    "switchyard_stage_duration_seconds",
    "Time per stage of a prediction: auth, rate_limit, routing, serialization (gateway), "
    "dispatch (to the agent and back), queue_wait and inference (on the agent).",
    ["tenant", "model", "stage"],
    buckets=STAGE_BUCKETS_S,
)
REJECTED = Counter(
    "switchyard_rejected_requests",
    "Prediction requests refused, by reason: unauthenticated, not_found, bad_input, "
    "rate_limit, overload (503: queue full, no ready agent, cold start past its hold).",
    ["tenant", "reason"],
)
TTFT = Histogram(
    "switchyard_generation_ttft_seconds",
    "Time to the first token of a generation.",
    ["tenant", "model", "version"],
    buckets=TTFT_BUCKETS_S,
)
ITL = Histogram(
    "switchyard_generation_inter_token_latency_seconds",
    "Time between tokens of a generation as the gateway receives them, one observation per "
    "token after the first: a chunk of several tokens counts its wait once per token, split "
    "evenly among them.",
    ["tenant", "model", "version"],
    buckets=ITL_BUCKETS_S,
)
TOKEN_RATE = Histogram(
    "switchyard_generation_tokens_per_second",
    "Decode speed of each finished generation (tokens after the first over the time they took).",
    ["tenant", "model", "version"],
    buckets=TOKEN_RATE_BUCKETS,
)
TOKENS = Counter(
    "switchyard_generated_tokens",
    "Tokens generated and streamed to clients.",
    ["tenant", "model", "version"],
)
COLD_START_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
COLD_START_WAIT = Histogram(
    "switchyard_cold_start_wait_seconds",
    "Requests a cold start held (a deployed version with no ready replica), by how the hold "
    "ended: ready (a replica became ready), timed_out (refused with 503 past the hold) or "
    "abandoned (the client left first).",
    ["tenant", "model", "version", "outcome"],
    buckets=COLD_START_BUCKETS_S,
)

DISPATCHED = Counter(
    "switchyard_gateway_dispatched",
    "Requests and streams handed to an agent, by path: local (on an agent link this gateway "
    "process holds), forwarded (through the channel layer to the process holding one), or "
    "retried (sent again to another replica: the first could not be reached or refused it "
    "unstarted).",
    ["path"],
)
DEGRADED = Counter(
    "switchyard_degraded_answers",
    "Predictions the version asked for failed and a lower step of the model's fallback ladder "
    "answered, by the version that failed and the step: fallback (another version) or "
    "default (the model's default answer).",
    ["tenant", "model", "version", "step"],
)
GRAPH_NODE_LATENCY = Histogram(
    "switchyard_graph_node_duration_seconds",
    "Time each node of a graph version took, from its dispatch to its answer (any status), by "
    "the graph's model and version and the node's name.",
    ["tenant", "model", "version", "node"],
    buckets=LATENCY_BUCKETS_S,
)
GRAPH_NODE_ERRORS = Counter(
    "switchyard_graph_node_errors",
    "Nodes of a graph version that failed the request, by the graph's model and version, the "
    "node's name and the status the node's failure answered.",
    ["tenant", "model", "version", "node", "status"],
)

# The prediction log's writer (gateway/predlog.py) counts straight into these: a few increments
# per batch on its own thread, and one per drop on the event loop (a labelled child, made once).
PREDLOG_RECORDS = Counter(
    "switchyard_prediction_log_records",
    "Sampled predictions by what became of them: written, or dropped and why: "
    "dropped_buffer_full (offered while the buffer was full, a storage stalled for longer "
    "than the buffer lasts), dropped_unrecordable (tensors the writer cannot describe), "
    "dropped_rejected (rows the storage refused, not for a stall), "
    "dropped_at_shutdown (still unwritten when the process stopped).",
    ["outcome"],
)
PREDLOG_RETRIES = Counter(
    "switchyard_prediction_log_write_retries",
    "Prediction-log batches the storage did not take (down, stalled, timed out): each stays "
    "in the buffer and is written again after a backoff.",
)
GENLOG_RECORDS = Counter(
    "switchyard_generation_log_records",
    "Sampled generations by what became of them: written, or dropped and why (as "
    "switchyard_prediction_log_records).",
    ["outcome"],
)
GENLOG_RETRIES = Counter(
    "switchyard_generation_log_write_retries",
    "Generation-log batches the storage did not take: each stays in the buffer and is written "
    "again after a backoff.",
)


def fold_dispatched(counts: dict[str, int]) -> None:
    """Move the pool's counts of local and forwarded dispatches into prometheus-client."""
    for path, n in counts.items():
        if n:
            DISPATCHED.labels(path).inc(n)
            counts[path] = 0


REJECT_REASONS = {
    401: "unauthenticated",
    403: "unauthenticated",
    404: "not_found",
    429: "rate_limit",
}


def reject_reason(status: int) -> str | None:
    """Why a request was refused, from its status; None for an answer or a server error."""
    if status in REJECT_REASONS:
        return REJECT_REASONS[status]
    if 400 <= status < 500:
        return "bad_input"
    if status == 503:
        return "overload"
    return None


class Observed:
    """One prediction as it goes through the pipeline: its ids, where its time went, and what
    the prediction log needs. ``mark`` charges the time since the previous mark to a stage."""

    __slots__ = (
        "trace",
        "predicting",
        "started",
        "_last",
        "stages",
        "tenant",
        "route",
        "arm",
        "names",
        "arrays",
        "outputs",
    )

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.predicting = False  # a prediction (counted and logged), not metadata or health
        self.started = self._last = time.perf_counter()
        self.stages: dict[str, float] = {}
        self.tenant = ""
        self.route: Route | None = None
        self.arm: str | None = None
        self.names: list[str] | None = None
        self.arrays: list[np.ndarray] | None = None
        self.outputs: list[tuple[str, np.ndarray]] | None = None

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._last
        self._last = now

    def agent_times(self, queue_ms: float, compute_ms: float) -> None:
        """Split the dispatch just marked into the agent's queue wait, its model run and the
        rest (the round trip over the websocket, framing, the agent's own overhead)."""
        queue, compute = queue_ms / 1000, compute_ms / 1000
        self.stages["queue_wait"] = self.stages.get("queue_wait", 0.0) + queue
        self.stages["inference"] = self.stages.get("inference", 0.0) + compute
        self.stages["dispatch"] = max(0.0, self.stages.get("dispatch", 0.0) - queue - compute)


@dataclass(slots=True)
class _Hist:
    counts: list[int]
    total: float = 0.0


@dataclass
class RequestMetrics:
    """This process's counts since the last fold into prometheus-client."""

    # Stage times are taken from one prediction in ``stage_every`` (counted per process): filling
    # the seven stage histograms for every request cost ~2.5 % of a small model's throughput in
    # bench/observability_bench.py (likely their memory gone cold between requests), and a
    # sample shows where the time goes as well. Requests and latency count every request.
    stage_every: int = 1
    requests: dict[tuple[Any, ...], int] = field(default_factory=dict)
    latency: dict[tuple[Any, ...], _Hist] = field(default_factory=dict)
    stages: dict[tuple[Any, ...], dict[str, _Hist]] = field(default_factory=dict)  # (tenant, model)
    rejected: dict[tuple[Any, ...], int] = field(default_factory=dict)
    degraded_answers: dict[tuple[Any, ...], int] = field(default_factory=dict)
    graph_nodes: dict[tuple[Any, ...], _Hist] = field(default_factory=dict)
    graph_node_errors: dict[tuple[Any, ...], int] = field(default_factory=dict)
    _until_stages: int = 0

    def graph_node(self, tenant: str, graph: Route, node: str, seconds: float, status: int) -> None:
        """One node of a graph answered (status 200) or failed the request (its status)."""
        labels = (tenant, graph.model_name, str(graph.version), node)
        _add(self.graph_nodes, labels, LATENCY_BUCKETS_S, seconds)
        if status != 200:
            key = (*labels, str(status))
            self.graph_node_errors[key] = self.graph_node_errors.get(key, 0) + 1

    def degraded(self, tenant: str, route: Route, step: str) -> None:
        key = (tenant, route.model_name, str(route.version), step)
        self.degraded_answers[key] = self.degraded_answers.get(key, 0) + 1

    def record(self, observed: Observed, status: int, seconds: float) -> None:
        route = observed.route
        tenant = observed.tenant
        if route is not None:
            labels = (tenant, route.model_name, str(route.version), observed.arm or "")
            key = (*labels, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            _add(self.latency, labels, LATENCY_BUCKETS_S, seconds)
            self._until_stages -= 1
            if self._until_stages <= 0:
                self._until_stages = self.stage_every
                self._record_stages(labels[:2], observed.stages)
        reason = reject_reason(status)
        if reason is not None:
            reject_key = (tenant, reason)
            self.rejected[reject_key] = self.rejected.get(reject_key, 0) + 1

    def _record_stages(self, tenant_model: tuple[Any, ...], spent: dict[str, float]) -> None:
        stages = self.stages.get(tenant_model)
        if stages is None:
            stages = self.stages[tenant_model] = {}
        for stage, seconds in spent.items():
            _add(stages, stage, STAGE_BUCKETS_S, seconds)

    def fold(self) -> None:
        """Move the counts into prometheus-client's metrics (shared files in multiprocess
        mode) and start afresh."""
        requests, self.requests = self.requests, {}
        latency, self.latency = self.latency, {}
        stages, self.stages = self.stages, {}
        rejected, self.rejected = self.rejected, {}
        degraded, self.degraded_answers = self.degraded_answers, {}
        nodes, self.graph_nodes = self.graph_nodes, {}
        node_errors, self.graph_node_errors = self.graph_node_errors, {}
        for key, n in requests.items():
            REQUESTS.labels(*key).inc(n)
        for key, hist in latency.items():
            _fold_histogram(LATENCY.labels(*key), hist)
        for (tenant, model), hists in stages.items():
            for stage, hist in hists.items():
                _fold_histogram(STAGES.labels(tenant, model, stage), hist)
        for key, n in rejected.items():
            REJECTED.labels(*key).inc(n)
        for key, n in degraded.items():
            DEGRADED.labels(*key).inc(n)
        for key, hist in nodes.items():
            _fold_histogram(GRAPH_NODE_LATENCY.labels(*key), hist)
        for key, n in node_errors.items():
            GRAPH_NODE_ERRORS.labels(*key).inc(n)


class LocalHistogram:
    """Observations counted in process (a bisect and an add) and folded into a prometheus-client
    histogram at once: for what is observed per token, where prometheus-client's own observe
    (2.6-4.3 µs in multiprocess mode) would be a real part of a token's cost."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.hist = _Hist([0] * (len(bounds) + 1))

    def observe(self, value: float, times: int = 1) -> None:
        self.hist.counts[bisect.bisect_left(self.bounds, value)] += times
        self.hist.total += value * times

    def fold_into(self, child: Histogram) -> None:
        hist, self.hist = self.hist, _Hist([0] * (len(self.bounds) + 1))
        if any(hist.counts):
            _fold_histogram(child, hist)


def _add(hists: dict[Any, _Hist], key: Hashable, bounds: tuple[Any, ...], value: float) -> None:
    hist = hists.get(key)
    if hist is None:
        hist = hists[key] = _Hist([0] * (len(bounds) + 1))
    hist.counts[bisect.bisect_left(bounds, value)] += 1  # le: value <= bound
    hist.total += value


def _fold_histogram(child: Histogram, hist: _Hist) -> None:
    # prometheus-client has no bulk observe: add to each bucket's value and the sum, which is
    # what observe() does one observation at a time (buckets are stored non-cumulative; the
    # last one is +Inf). These are its private attributes, so this is the one place that
    # touches them: pyproject.toml bounds the version, and tests/test_metrics.py checks that a
    # fold writes what observe() would.
    try:
        buckets, total = child._buckets, child._sum
    except AttributeError:
        raise RuntimeError(
            "this prometheus-client keeps a histogram's values elsewhere: gateway.metrics "
            "cannot fold its counts; install a version within pyproject.toml's bound"
        ) from None
    for value, n in zip(buckets, hist.counts, strict=True):
        if n:
            value.inc(n)
    total.inc(hist.total)


# Scrape -----------------------------------------------------------------------------------


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


SCHEDULER_DROPS = ("expired", "cancelled", "shed")


class FleetCollector:
    """Agent metrics from the live sessions' latest heartbeats (read when scraped)."""

    def collect(self) -> Iterator[Metric]:
        rows = fleet_rows()
        agent_labels = ["agent", "node", "deployment"]
        gauges = {
            name: GaugeMetricFamily(f"switchyard_agent_{name}", doc, labels=agent_labels)
            for name, doc in (
                ("queue_depth", "Requests waiting for a batch on the agent."),
                ("in_flight", "Requests queued or running on the agent."),
                ("load_avg", "Requests in the agent on average over the last heartbeat."),
                ("memory_used_bytes", "Memory the agent's loaded versions hold."),
                ("memory_budget_bytes", "The agent's memory budget."),
            )
        }
        batch = HistogramMetricFamily(
            "switchyard_agent_batch_size",
            "Rows per model run on the agent since it started.",
            labels=agent_labels,
        )
        load = GaugeMetricFamily(
            "switchyard_model_load_seconds",
            "Time an agent took to download, load and warm up a version.",
            labels=["agent", "tenant", "model", "version"],
        )
        # The agent's scheduler since it started (Heartbeat's *_total): requests it dropped
        # before compute, by reason. A restarted agent starts again at 0, as a counter may.
        dropped = CounterMetricFamily(
            "switchyard_agent_scheduler_dropped",
            "Requests the agent's scheduler dropped before compute, by reason: expired (past "
            "their deadline), cancelled (their caller gave up), shed (refused or evicted for "
            "load, over_share included).",
            labels=[*agent_labels, "reason"],
        )
        gpu_labels = ["agent", "gpu"]
        gpu_util = GaugeMetricFamily(
            "switchyard_gpu_utilization_ratio", "GPU utilisation (NVML).", labels=gpu_labels
        )
        gpu_used = GaugeMetricFamily(
            "switchyard_gpu_memory_used_bytes", "GPU memory in use.", labels=gpu_labels
        )
        gpu_total = GaugeMetricFamily(
            "switchyard_gpu_memory_total_bytes", "GPU memory.", labels=gpu_labels
        )
        for row in rows:
            labels = [row.agent, row.node, row.deployment]
            stats = row.stats
            for name, gauge in gauges.items():
                gauge.add_metric(labels, float(stats.get(name, 0) or 0))
            for reason in SCHEDULER_DROPS:
                dropped.add_metric([*labels, reason], float(stats.get(f"{reason}_total", 0) or 0))
            counts = stats.get("batch_size_counts") or []
            if len(counts) == len(BATCH_SIZE_BOUNDS) + 1:
                cumulative, running = [], 0
                for bound, n in zip([*BATCH_SIZE_BOUNDS, math.inf], counts, strict=True):
                    running += n
                    cumulative.append((floatToGoString(bound), running))
                batch.add_metric(labels, cumulative, float(stats.get("batch_rows_total", 0)))
            for version in stats.get("versions", []):
                named = row.versions.get(version.get("version_id"))
                if named is not None and version.get("load_s"):
                    load.add_metric([row.agent, *named], float(version["load_s"]))
            for gpu in stats.get("gpus", []):
                g = [row.agent, str(gpu.get("index", 0))]
                gpu_util.add_metric(g, float(gpu.get("utilization_pct", 0)) / 100)
                gpu_used.add_metric(g, float(gpu.get("memory_used_bytes", 0)))
                gpu_total.add_metric(g, float(gpu.get("memory_total_bytes", 0)))
        yield from gauges.values()
        yield from (batch, dropped, load, gpu_util, gpu_used, gpu_total)


class PlatformCollector:
    """What the database holds that dashboards and alert rules join against, read when
    scraped: each model's SLO objectives (``monitoring.prometheus_rules``) and each tenant's
    monthly budget."""

    def collect(self) -> Iterator[Metric]:
        objective = GaugeMetricFamily(
            "switchyard_slo_objective",
            "Each model's SLO objectives (Model.slo_*): the share of requests to answer without "
            "a server error (sli=availability) or within the latency threshold (sli=latency; "
            "le: the largest latency bucket wholly within it, as the rules count fast requests).",
            labels=["tenant", "model", "sli", "le"],
        )
        for row in model_objectives():
            objective.add_metric([row.tenant, row.model, "availability", ""], row.availability)
            le = fast_bucket_le(row.latency_ms)
            objective.add_metric([row.tenant, row.model, "latency", le], row.latency_target)
        labels = ["tenant", "currency"]
        limit = GaugeMetricFamily(
            "switchyard_tenant_budget_limit", "A tenant's monthly budget.", labels=labels
        )
        spent = GaugeMetricFamily(
            "switchyard_tenant_budget_spent",
            "What a tenant spent this UTC month, as of the last usage roll-up.",
            labels=labels,
        )
        stopped = GaugeMetricFamily(
            "switchyard_tenant_budget_stopped",
            "1 while a tenant's spent budget's hard stop refuses new work (no override).",
            labels=["tenant"],
        )
        for slug, currency, monthly, so_far, refusing in budget_figures():
            limit.add_metric([slug, currency], monthly)
            spent.add_metric([slug, currency], so_far)
            stopped.add_metric([slug], 1.0 if refusing else 0.0)
        yield from (objective, limit, spent, stopped)


def fast_bucket_le(threshold_ms: float) -> str:
    """The ``le`` of the largest request-latency bucket wholly within the threshold: a request
    in the bucket that straddles it counts as slow, as ``monitoring.slo`` counts it. The
    model's validators keep thresholds at or above the smallest bucket (0.5 ms)."""
    within = [b for b in LATENCY_BUCKETS_S if b * 1000 <= threshold_ms * (1 + 1e-9)]
    return floatToGoString(float(within[-1] if within else LATENCY_BUCKETS_S[0]))


@dataclass
class AgentRow:
    agent: str
    node: str
    deployment: str
    stats: dict[str, Any]
    versions: dict[int, tuple[str, str, str]]  # version id -> (tenant, model, version)


def fleet_rows() -> list[AgentRow]:
    """The live agent sessions with their latest heartbeat, and their versions' names."""
    sessions = list(live_sessions().select_related("node").order_by("pk"))
    ids = {v.get("version_id") for s in sessions for v in (s.stats or {}).get("versions", [])}
    names = {
        pk: (tenant, model, str(number))
        for pk, tenant, model, number in ModelVersion.objects.filter(pk__in=ids).values_list(
            "pk", "model__tenant__slug", "model__name", "version"
        )
    }
    return [
        AgentRow(
            agent=f"{s.node.name}#{s.pk}",
            node=s.node.name,
            deployment=s.deployment_name,
            stats=s.stats or {},
            versions=names,
        )
        for s in sessions
    ]


_fleet_registry = CollectorRegistry(auto_describe=False)
_fleet_registry.register(FleetCollector())
_fleet_registry.register(PlatformCollector())


def exposition() -> bytes:
    """The text exposition: this process's (or, in multiprocess mode, every process's) data
    path metrics, then the fleet's. Reads the database (the fleet): call it off the loop."""
    if multiprocess():
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    else:
        registry = REGISTRY
    return generate_latest(registry) + generate_latest(_fleet_registry)
