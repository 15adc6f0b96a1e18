"""In-process CPU cost of metrics, tracing and the prediction log per request, without the
noise of a full-path run: the per-request bookkeeping (trace ids, eight stage marks, the
metrics record and its fold), a sampled ``PredictionLogger.offer`` (one row of 32 features,
queued as it is), and the writer's CPU per record (building it, then COPY on PostgreSQL or
bulk_create on SQLite), in full batches of 500 and in batches of 30 (what one flush a second
takes from a server answering 300 requests a second, as in the full-path bench).

Run: ``.venv/bin/python bench/observability_costs.py`` (uses ``DATABASE_URL`` when set; it
creates its rows in a tenant of its own and deletes it afterwards).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")

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
    how = "COPY" if django.db.connection.vendor == "postgresql" else "bulk_create"
    print(f"| writer thread (build the record, {how}) | {writer:.1f} us per record |")
    print(f"| the same in batches of 30 | {writer_small:.1f} us per record |")
    print(f"| metrics + 10 % logging, per request | {metrics_us + log_us:.1f} us |")


if __name__ == "__main__":
    main()
