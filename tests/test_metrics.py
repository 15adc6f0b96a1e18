"""Request metrics counted in process and folded into prometheus-client, the fleet's metrics
from heartbeats, request ids and trace context."""

from __future__ import annotations

import logging
import random

import pytest
from asgiref.sync import async_to_sync
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway import metrics, scrape, tracing
from gateway.metrics import LATENCY_BUCKETS_S, Observed, RequestMetrics, reject_reason
from gateway.routes import Route
from gateway.state import GatewayState
from tests.factories import make_model, make_version


def samples_of(text: str, name: str, **labels: str) -> dict[str, float]:
    """{le or sample name: value} of one labelled series in an exposition."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(name) and all(s.labels.get(k) == v for k, v in labels.items()):
                found[s.labels.get("le", s.name)] = s.value
    return found


def route(version: int = 3) -> Route:
    return Route(
        tenant_id=1,
        model_name="fold-test",
        version_id=99,
        model_id=7,
        version=version,
        task="classifier",
        inputs=(),
        outputs=(),
        feature_names=(),
    )


def test_folding_counts_equals_observing_each_request():
    """The bulk fold writes what observe() would have written one request at a time."""
    rng = random.Random(5)
    latencies = [rng.lognormvariate(-5, 1.5) for _ in range(500)] + [0.001, 0.0005, 20.0]
    pending = RequestMetrics()
    for seconds in latencies:
        observed = Observed(tracing.start_trace(None, None))
        observed.tenant, observed.route, observed.arm = "t-fold", route(), "candidate"
        pending.record(observed, 200, seconds)
    pending.fold()
    assert pending.requests == {} and pending.latency == {}  # started afresh

    reference = CollectorRegistry()
    direct = Histogram("direct", "", buckets=LATENCY_BUCKETS_S, registry=reference)
    for seconds in latencies:
        direct.observe(seconds)
    want = samples_of(generate_latest(reference).decode(), "direct")

    from prometheus_client import REGISTRY

    got = samples_of(
        generate_latest(REGISTRY).decode(),
        "switchyard_request_duration_seconds",
        tenant="t-fold",
        model="fold-test",
        version="3",
        arm="candidate",
    )
    buckets = {k: v for k, v in got.items() if not k.startswith("switchyard")}
    assert buckets == {k: v for k, v in want.items() if not k.startswith("direct")}
    assert got["switchyard_request_duration_seconds_sum"] == pytest.approx(want["direct_sum"])
    assert got["switchyard_request_duration_seconds_count"] == len(latencies)
    counted = samples_of(
        generate_latest(REGISTRY).decode(), "switchyard_requests_total", tenant="t-fold"
    )
    assert counted == {"switchyard_requests_total": len(latencies)}


def test_the_installed_prometheus_client_is_one_the_fold_was_checked_with():
    """The fold writes prometheus-client's private per-bucket values: pyproject.toml bounds the
    version (the test above checks the fold on it), and a version past the bound fails here
    first, naming the bound, rather than in a scrape."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = next(
        Requirement(r)
        for r in pyproject["project"]["dependencies"]
        if Requirement(r).name == "prometheus-client"
    )
    assert declared.specifier.contains(version("prometheus-client")), declared
    probe = Histogram("probe", "", buckets=(1.0, 2.0), registry=None)
    assert len(probe._buckets) == 3 and hasattr(probe._sum, "inc")


@pytest.mark.parametrize(
    "status, reason",
    [
        (200, None),
        (400, "bad_input"),
        (413, "bad_input"),
        (401, "unauthenticated"),
        (404, "not_found"),
        (429, "rate_limit"),
        (503, "overload"),
        (500, None),
        (504, None),
    ],
)
def test_rejections_are_counted_by_reason(status, reason):
    assert reject_reason(status) == reason


def test_stage_times_come_from_one_prediction_in_stage_every_and_the_rest_from_every_one():
    pending = RequestMetrics(stage_every=4)
    for _ in range(8):
        observed = Observed(tracing.start_trace(None, None))
        observed.tenant, observed.route = "t-sample", route()
        observed.stages = {"auth": 0.001, "inference": 0.002}
        pending.record(observed, 200, 0.003)
    assert sum(pending.requests.values()) == 8
    assert sum(sum(h.counts) for h in pending.latency.values()) == 8
    stages = pending.stages[("t-sample", route().model_name)]
    assert {name: sum(h.counts) for name, h in stages.items()} == {"auth": 2, "inference": 2}


def test_stage_times_split_the_dispatch_with_the_agents_report():
    observed = Observed(tracing.start_trace(None, None))
    observed.stages = {"dispatch": 0.010}
    observed.agent_times(queue_ms=2.0, compute_ms=5.0)
    assert observed.stages == pytest.approx(
        {"dispatch": 0.003, "queue_wait": 0.002, "inference": 0.005}
    )


@pytest.mark.django_db
def test_fleet_metrics_come_from_live_heartbeats(world, onnx_bytes):
    from fleet.models import AgentSession, Node

    version = make_version(make_model(world.a, "fraud"), onnx_bytes)
    node = Node.objects.create(name="gpu-1", token_prefix="p1", token_hash="h")
    counts = [4, 1] + [0] * 9
    AgentSession.objects.create(
        node=node,
        channel_name="c1",
        deployment_name="sy-agent-1-v1",
        stats={
            "queue_depth": 3,
            "in_flight": 5,
            "memory_used_bytes": 1024,
            "batch_size_counts": counts,
            "batch_rows_total": 6,
            "versions": [{"version_id": version.pk, "load_s": 0.75}],
            "gpus": [{"index": 0, "utilization_pct": 40.0, "memory_used_bytes": 2048}],
        },
    )
    text = metrics.exposition().decode()
    agent = {"agent": f"gpu-1#{AgentSession.objects.get().pk}"}
    assert samples_of(text, "switchyard_agent_queue_depth", **agent) == {
        "switchyard_agent_queue_depth": 3.0
    }
    batch = samples_of(text, "switchyard_agent_batch_size", **agent)
    assert batch["1.0"] == 4 and batch["2.0"] == 5 and batch["+Inf"] == 5
    assert batch["switchyard_agent_batch_size_sum"] == 6
    load = samples_of(text, "switchyard_model_load_seconds", tenant="alpha", model="fraud")
    assert load == {"switchyard_model_load_seconds": 0.75}
    gpu = samples_of(text, "switchyard_gpu_utilization_ratio", gpu="0")
    assert gpu == {"switchyard_gpu_utilization_ratio": 0.4}


@pytest.mark.django_db
def test_scheduler_counts_of_a_heartbeat_are_counters_per_agent(world):
    from fleet.models import AgentSession, Node
    from serving_agent.protocol import Heartbeat

    node = Node.objects.create(name="cpu-2", token_prefix="p2", token_hash="h")
    beat = Heartbeat(expired_total=4, cancelled_total=2, shed_total=7)
    session = AgentSession.objects.create(
        node=node, channel_name="c2", deployment_name="", stats=beat.model_dump()
    )
    text = metrics.exposition().decode()
    agent = {"agent": f"cpu-2#{session.pk}", "node": "cpu-2"}
    found = {
        reason: samples_of(text, "switchyard_agent_scheduler_dropped_total", reason=reason, **agent)
        for reason in ("expired", "cancelled", "shed")
    }
    assert found == {
        "expired": {"switchyard_agent_scheduler_dropped_total": 4.0},
        "cancelled": {"switchyard_agent_scheduler_dropped_total": 2.0},
        "shed": {"switchyard_agent_scheduler_dropped_total": 7.0},
    }


def test_trace_context_is_kept_or_started():
    kept = tracing.start_trace("req-1", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
    assert kept.request_id == "req-1" and kept.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert kept.traceparent.endswith("-00") and "00f067aa0ba902b7" not in kept.traceparent
    for invalid in ("garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "01-abc"):
        fresh = tracing.start_trace(None, invalid)
        assert len(fresh.trace_id) == 32 and fresh.trace_id != "0" * 32
        assert len(fresh.request_id) == 32
    with pytest.raises(tracing.BadRequestId, match="x-request-id"):
        tracing.start_trace("x" * 129, None)


def test_log_records_carry_the_request_and_trace_ids():
    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.INFO)
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    handler = Collect()
    handler.addFilter(tracing.TraceLogFilter())
    logger = logging.getLogger("tests.tracing")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    trace = tracing.start_trace("order-7", None)
    try:
        token = tracing.current.set(trace)
        logger.info("inside")
        tracing.current.reset(token)
        logger.info("outside")
    finally:
        logger.removeHandler(handler)
    inside, outside = handler.records
    assert (inside.request_id, inside.trace_id) == ("order-7", trace.trace_id)
    assert (outside.request_id, outside.trace_id) == ("-", "-")


def scrape_with(headers: dict[str, str]) -> tuple[int, dict[bytes, bytes], bytes]:
    """(status, headers, body) of one GET /metrics through the ASGI app."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/metrics",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    async_to_sync(scrape.metrics_app)(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def test_metrics_need_the_scrape_token_by_default(settings):
    assert settings.SWITCHYARD_METRICS_TOKEN  # generated for this install when not set
    settings.SWITCHYARD_METRICS_TOKEN = "the-token"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "the-token"}):
        status, sent, body = scrape_with(headers)
        assert status == 401 and sent[b"www-authenticate"] == b"Bearer", headers
        assert b"switchyard_" not in body and b"the-token" not in body


@pytest.mark.django_db(transaction=True)
def test_metrics_answer_with_the_token_or_when_made_public(settings, monkeypatch):
    monkeypatch.setattr(scrape, "get_state", GatewayState)
    settings.SWITCHYARD_METRICS_TOKEN = "the-token"
    status, _, body = scrape_with({"Authorization": "Bearer the-token"})
    assert status == 200 and b"switchyard_" in body
    settings.SWITCHYARD_METRICS_TOKEN = ""  # SWITCHYARD_METRICS_PUBLIC=on
    status, _, body = scrape_with({})
    assert status == 200 and b"switchyard_" in body
