"""In-process CPU cost of metrics, tracing and the prediction log per request, without the
noise of a full-path run: the per-request bookkeeping (trace ids, eight stage marks, the
metrics record and its fold), a sampled ``PredictionLogger.offer`` (one row of 32 features,
queued as it is), and the writer's CPU per record (Arrow columns from the stacked tensors, then
one Parquet file per flush, in a temporary directory), in full batches of 500 and in batches of
30 (what one flush a second takes from a server answering 300 requests a second, as in the
full-path bench). bench/predlog_bench.py measures the log at 10,000 rows a second.

Run: ``.venv/bin/python bench/observability_costs.py`` (uses ``DATABASE_URL`` when set; it
creates its rows in a tenant of its own and deletes it afterwards).

``--spans``: OpenTelemetry spans only (no database): the per-request bookkeeping of a front
door (ids, sampling decision, stage marks, the after-reply check) with tracing off, and on at
0 %, 10 % and 100 % of fresh traces, each with the spans' export (the batch processor's thread
encoding them as OTLP protobuf: everything but the socket write) included; and the agent's
spans of one sampled request.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")
os.environ.setdefault("SWITCHYARD_LOG_ROOT", tempfile.mkdtemp(prefix="sy-costs-logs-"))

import django  # noqa: E402

django.setup()

import numpy as np  # noqa: E402
from django.core.management import call_command  # noqa: E402

from gateway import metrics, predlog, tracing  # noqa: E402
from gateway.routes import InputSpec, Route  # noqa: E402
from registry.services import create_version  # noqa: E402
from tests.factories import make_model, make_tenant  # noqa: E402
from tests.onnx_models import small_onnx  # noqa: E402

N = 20_000
STAGES = ("auth", "rate_limit", "routing", "serialization", "routing", "dispatch")


def per_call_us(fn, n: int) -> float:
    started = time.process_time()
    for i in range(n):
        fn(i)
    return (time.process_time() - started) / n * 1e6


def main() -> None:
    call_command("migrate", verbosity=0)
    tenant = make_tenant(f"costs-{os.getpid()}")
    try:
        model = make_model(tenant, "costs")
        version = create_version(model, small_onnx())
        route = Route(
            tenant_id=tenant.pk,
            model_name="costs",
            version_id=version.pk,
            model_id=model.pk,
            version=1,
            task="classifier",
            inputs=(InputSpec("x", "FP32", np.dtype("<f4"), (-1, 32)),),
            outputs=({"name": "y", "datatype": "FP32", "shape": [-1, 2]},),
            feature_names=tuple(f"f{i}" for i in range(32)),
            log_sample_rate=1.0,
        )
        x = [np.random.default_rng(0).normal(size=(1, 32)).astype(np.float32)]
        y = [("y", np.array([[0.3, 0.7]], dtype=np.float32))]
        pending = metrics.RequestMetrics()

        def trace(_: int) -> None:
            metrics.Observed(tracing.start_trace(None, None))

        def observe(i: int) -> None:
            observed = metrics.Observed(tracing.start_trace(None, None))
            observed.tenant, observed.route = "t", route
            for stage in STAGES:
                observed.mark(stage)
            observed.agent_times(0.1, 0.2)
            pending.record(observed, 200, 0.003)
            if i % 1000 == 0:  # the refresh loop folds every 0.5 s
                pending.fold()

        def offer(logger: predlog.PredictionLogger, i: int) -> None:
            logger.offer(
                route,
                arm=None,
                request_id=f"r{i}",
                trace_id="t",
                names=["x"],
                arrays=x,
                outputs=y,
                latency_s=0.003,
                status=200,
            )

        def writer_us(batch_size: int) -> float:
            logger = predlog.PredictionLogger(
                capacity=10**6, batch_size=batch_size, autostart=False
            )
            for i in range(3000):
                offer(logger, i)
            started = time.process_time()
            logger.write_pending()
            return (time.process_time() - started) / logger.written * 1e6

        ids = per_call_us(trace, N)
        bookkeeping = per_call_us(observe, N)
        queue = predlog.PredictionLogger(capacity=10**6, autostart=False)
        sampled = per_call_us(lambda i: offer(queue, i), 5000)
        writer = writer_us(500)
        writer_small = writer_us(30)
    finally:
        tenant.delete()
    metrics_us = bookkeeping - ids
    log_us = 0.1 * (sampled + writer)
    print(f"database: {django.db.connection.vendor}")
    print("| part | CPU per request |")
    print("| --- | --- |")
    print(f"| request id + trace context (both configurations) | {ids:.1f} us |")
    print(f"| metrics: stage marks, record, fold | {metrics_us:.1f} us |")
    print(f"| sampled offer (queue the tensors) | {sampled:.1f} us per sampled request |")
    print(f"| writer thread (Arrow columns, a Parquet file) | {writer:.1f} us per record |")
    print(f"| the same in batches of 30 | {writer_small:.1f} us per record |")
    print(f"| metrics + 10 % logging, per request | {metrics_us + log_us:.1f} us |")


def span_costs() -> None:
    """CPU per request of spans, by sampling rate (``--spans``)."""
    from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from gateway import spans
    from platform_site import telemetry
    from serving_agent import telemetry as agent_telemetry
    from serving_agent._serving import record_spans
    from serving_agent.protocol import FrameTensor, InferRequest

    class Encoding(SpanExporter):
        """What the OTLP exporter does with a batch, short of sending it."""

        def export(self, batch):  # type: ignore[no-untyped-def]
            encode_spans(batch).SerializeToString()
            return SpanExportResult.SUCCESS

    # A queue that holds a whole run: the default (2048 spans) would drop most of them.
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(2**21)
    route = Route(
        tenant_id=1,
        model_name="costs",
        version_id=1,
        model_id=1,
        version=1,
        task="classifier",
        inputs=(),
        outputs=(),
        feature_names=(),
    )
    door = spans.HttpDoor(spans.oip_route, spans.scope_request)
    scope = {"method": "POST", "path": "/v2/models/costs/infer"}

    def request(_: int) -> None:
        # What a front door's Call does with the ids, then its stages and its finish.
        trace = tracing.start_trace(None, None)
        if telemetry.exporting is None or not trace.sampled:
            observed = metrics.Observed(trace)
        else:
            observed = spans.Timeline(trace, door, scope)
        observed.tenant, observed.route = "t", route
        for stage in STAGES:
            observed.mark(stage)
        observed.agent_times(0.1, 0.2)
        observed.mark("serialization")
        if type(observed) is spans.Timeline:
            spans.export(observed, 200)

    def run(n: int) -> float:
        started = time.process_time()
        for i in range(n):
            request(i)
        telemetry.flush(60)  # the export thread's CPU is the process's too
        return (time.process_time() - started) / n * 1e6

    rows = []
    telemetry.shutdown()
    off = run(N)
    rows.append(("off (no pipeline)", off))
    for label, ratio in (("0 %", "0"), ("10 %", "0.1"), ("100 %", "1")):
        env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": ratio}
        telemetry.configure(env=env, exporter=Encoding())
        rows.append((label, run(N if ratio != "1" else N // 4)))
        telemetry.shutdown()

    # The agent: one sampled request's three spans (and an unsampled one's test).
    x = FrameTensor(name="x", datatype="FP32", shape=[1, 32])
    sampled = InferRequest(id=1, version_id=1, inputs=[x], trace=f"00-{'ab' * 16}-{'cd' * 8}-01")
    unsampled = InferRequest(id=1, version_id=1, inputs=[x], trace=f"00-{'ab' * 16}-{'cd' * 8}-00")
    agent_telemetry.exporting = agent_telemetry.Exporting(
        "bench", agent_telemetry.sampling_from_env({}), Encoding()
    )

    def agent(which: InferRequest, n: int) -> float:
        started = time.process_time()
        for _ in range(n):
            record_spans(which, 0.0, 0.001, 0.0002, 0.0005)
        assert agent_telemetry.exporting is not None
        agent_telemetry.exporting.flush(60)
        return (time.process_time() - started) / n * 1e6

    agent_sampled, agent_unsampled = agent(sampled, N // 4), agent(unsampled, N)
    agent_telemetry.exporting.shutdown()
    agent_telemetry.exporting = None

    print("| tracing | gateway CPU per request (ids, marks, spans and their encoding) | vs off |")
    print("| --- | --- | --- |")
    for label, us in rows:
        print(f"| {label} | {us:.2f} us | {us - off:+.2f} us |")
    print(f"| agent, a sampled request's 3 spans | {agent_sampled:.2f} us | |")
    print(f"| agent, an unsampled request (on) | {agent_unsampled:.2f} us | |")


if __name__ == "__main__":
    if "--spans" in sys.argv:
        span_costs()
    else:
        main()
