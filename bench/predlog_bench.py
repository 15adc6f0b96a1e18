"""The prediction log on Parquet, measured: the writer's CPU at 10,000 logged rows a second, drift
over a million logged rows, and the pages that read the log on a day of logs.

Parts (``--part``, each prints a Markdown table; medians of ``--repeat`` runs):

- ``writer``: 10,000 logged rows a second of a 32-feature classifier, as one-row requests and as
  requests of 32 rows. The event loop's cost (``PredictionLogger.offer`` per sampled request,
  times the requests a second) plus the writer thread's CPU (``time.thread_time``: building the
  Arrow columns from the stacked tensors and writing one zstd Parquet file per flush to local
  disk), as a share of one core.
- ``drift``: a million logged rows (100,000 requests of 10 rows, 8 numeric features, written by
  the writer's own ``build_table`` into one hour's partition), and ``detect_drift`` over them:
  seconds.
- ``pages``: a day of logs (``--requests`` one-row requests spread over 24 hours, 1 in 100
  labelled), then the predictions page (its table and hourly quality chart), the drift page, the
  quality API and the drift job, timed through Django's test client. Runs as well in a
  checkout from before the log left the database (it then fills PostgreSQL's table with the
  old writer's COPY), which is how bench/README.md compares the two: ``git worktree add
  /tmp/old-tree <commit>`` and run this file there with its own ``DATABASE_URL``.

Run: ``.venv/bin/python bench/predlog_bench.py --part writer|drift|pages`` (``DATABASE_URL`` for
PostgreSQL; a tenant of its own, deleted afterwards; log files in a temporary directory).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")
LOG_ROOT = tempfile.mkdtemp(prefix="sy-predlog-bench-")
os.environ["SWITCHYARD_LOG_ROOT"] = LOG_ROOT

import django  # noqa: E402

django.setup()

import numpy as np  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402

from gateway import predlog  # noqa: E402
from gateway.routes import InputSpec, Route  # noqa: E402
from monitoring import models as monitoring_models  # noqa: E402
from registry.models import ReferenceSample  # noqa: E402
from registry.services import create_version  # noqa: E402
from tests.factories import make_member, make_model, make_tenant  # noqa: E402
from tests.onnx_models import small_onnx  # noqa: E402

ON_PARQUET = not hasattr(monitoring_models, "PredictionLog")
settings.ALLOWED_HOSTS = ["*"]


def route_for(version, features: int, rate: float = 1.0) -> Route:
    model = version.model
    return Route(
        tenant_id=model.tenant_id,
        model_name=model.name,
        version_id=version.pk,
        model_id=model.pk,
        version=version.version,
        task="classifier",
        inputs=(InputSpec("x", "FP32", np.dtype("<f4"), (-1, features)),),
        outputs=({"name": "y", "datatype": "FP32", "shape": [-1, 2]},),
        feature_names=tuple(f"f{i}" for i in range(features)),
        log_sample_rate=rate,
    )


def samples(route: Route, requests: int, rows: int, at: np.ndarray, rng) -> list[predlog.Sample]:
    features = len(route.feature_names)
    x = rng.normal(40, 10, size=(requests, rows, features)).astype(np.float32)
    p = rng.random((requests, rows, 1)).astype(np.float32)
    y = np.concatenate([1 - p, p], axis=2)
    return [
        predlog.Sample(
            route,
            "",
            uuid.uuid4().hex,
            "",
            ["x"],
            [x[i]],
            [("y", y[i])],
            0.003,
            200,
            float(at[i]),
        )
        for i in range(requests)
    ]


# The writer -------------------------------------------------------------------------------------


def writer_part(version, repeat: int) -> None:
    rng = np.random.default_rng(0)
    route = route_for(version, 32)
    print("| requests | rows a second | offer on the event loop | writer thread | total |")
    print("| --- | --- | --- | --- | --- |")
    for rows in (1, 32):
        per_second = 10_000 // rows
        offers, writes = [], []
        for _ in range(repeat):
            logger = predlog.PredictionLogger(
                capacity=10**6, batch_size=settings.SWITCHYARD_PREDLOG_BATCH, autostart=False
            )
            x = rng.normal(size=(rows, 32)).astype(np.float32)
            y = np.tile(np.array([[0.3, 0.7]], np.float32), (rows, 1))
            n = 2 * per_second  # two seconds of traffic: one flush at the default 2 s
            gc.collect()  # not a collection of the whole process, once, inside the timing
            started = time.thread_time()
            for i in range(n):
                logger.offer(
                    route,
                    arm=None,
                    request_id=f"r{i}",
                    trace_id="t",
                    names=["x"],
                    arrays=[x],
                    outputs=[("y", y)],
                    latency_s=0.003,
                    status=200,
                )
            offers.append((time.thread_time() - started) / n)
            started = time.thread_time()
            assert logger.write_pending()
            writes.append((time.thread_time() - started) / 2)  # per second of traffic
            assert logger.written == n
        offer_s = statistics.median(offers) * per_second
        write_s = statistics.median(writes)
        print(
            f"| {rows} row{'s' if rows > 1 else ''} each ({per_second:,}/s) | 10,000 "
            f"| {offer_s * 100:.1f} % ({statistics.median(offers) * 1e6:.2f} us each) "
            f"| {write_s * 100:.1f} % | {(offer_s + write_s) * 100:.1f} % of a core |"
        )


# Drift over a million rows ---------------------------------------------------------------------


def drift_part(tenant, repeat: int) -> None:
    from monitoring.drift import detect_drift
    from monitoring.logstore import log_store
    from monitoring.prediction_log import PREDICTIONS

    rng = np.random.default_rng(1)
    model = make_model(tenant, "drift-million")
    model.drift_window_minutes = 60
    model.save()
    version = create_version(model, small_onnx())
    route = route_for(version, 8)
    now = timezone.now()
    ReferenceSample.objects.create(
        version=version,
        source="upload",
        columns={f"f{i}": rng.normal(40, 10, 2000).round(2).tolist() for i in range(8)},
        scores=rng.random(2000).round(4).tolist(),
        rows=2000,
    )
    store = log_store()
    started = time.perf_counter()
    at = now.timestamp() - rng.uniform(60, 3000, 100_000)
    for chunk in range(10):  # 10 flushes of 10,000 requests of 10 rows
        part = samples(route, 10_000, 10, at[chunk * 10_000 : (chunk + 1) * 10_000], rng)
        for piece in store.split(PREDICTIONS, predlog.build_table(part, b"k")):
            store.put(piece)
    filled = time.perf_counter() - started
    files = store.files(PREDICTIONS, tenant.pk, [model.pk])
    rows = store.row_count(files)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        report = detect_drift(version, now)
        times.append(time.perf_counter() - started)
        assert report is not None and report.rows_current == 1_000_000, report
    print(f"(written in {filled:.1f} s: {len(files)} files, {rows:,} requests)")
    print("| drift job over | seconds (median) | runs |")
    print("| --- | --- | --- |")
    print(
        f"| 1,000,000 logged rows, 8 features + scores | {statistics.median(times):.2f} "
        f"| {', '.join(f'{t:.2f}' for t in times)} |"
    )


# Pages on a day of logs ------------------------------------------------------------------------


def fill_day(version, requests: int, rng) -> list[str]:
    """``requests`` one-row requests over the last 24 hours; returns their request ids."""
    now = timezone.now().timestamp()
    route = route_for(version, 8)
    ids: list[str] = []
    for start in range(0, requests, 20_000):
        n = min(20_000, requests - start)
        at = now - rng.uniform(0, 86_400, n)
        batch = samples(route, n, 1, at, rng)
        ids += [s.request_id for s in batch]
        if ON_PARQUET:
            from monitoring.logstore import log_store
            from monitoring.prediction_log import PREDICTIONS

            store = log_store()
            for piece in store.split(PREDICTIONS, predlog.build_table(batch, b"k")):
                store.put(piece)
        else:
            predlog.write_batch(predlog.batch_records(batch, b"k", []))
    if ON_PARQUET:
        # The steady state of a day: every hour closed long enough is compacted (the hourly
        # task), the current one holds its flushes' files.
        from monitoring.prediction_log import compact_closed_hours

        compact_closed_hours(timezone.now())
    return ids


def pages_part(tenant, requests: int, repeat: int) -> None:
    from monitoring.drift import detect_drift
    from monitoring.models import Feedback

    rng = np.random.default_rng(2)
    model = make_model(tenant, "day")
    version = create_version(model, small_onnx())
    ReferenceSample.objects.create(
        version=version,
        source="upload",
        columns={f"f{i}": rng.normal(40, 10, 2000).round(2).tolist() for i in range(8)},
        scores=rng.random(2000).round(4).tolist(),
        rows=2000,
    )
    started = time.perf_counter()
    ids = fill_day(version, requests, rng)
    now = timezone.now()
    Feedback.objects.bulk_create(
        [
            Feedback(tenant=tenant, request_id=rid, label=int(rng.integers(2)), received_at=now)
            for rid in ids[::100]
        ]
    )
    print(
        f"(filled {requests:,} requests and {len(ids[::100]):,} labels in "
        f"{time.perf_counter() - started:.1f} s; on Parquet: {ON_PARQUET})"
    )
    user = make_member(tenant, f"bench-{uuid.uuid4().hex[:6]}", "engineer")
    client = Client()
    client.force_login(user)
    urls = {
        "predictions page (first page + 48 h quality chart)": f"/models/{model.name}/predictions/",
        "predictions page, filtered by request id": (
            f"/models/{model.name}/predictions/?request_id={ids[len(ids) // 2]}"
        ),
        "predictions page, page 100": f"/models/{model.name}/predictions/?page=100",
        "drift page": f"/models/{model.name}/drift/",
        "quality API (hourly, 24 h)": f"/api/v1/models/{model.name}/quality",
    }
    print("| page on a day of logs | median ms | runs (ms) |")
    print("| --- | --- | --- |")
    for name, url in urls.items():
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            response = client.get(url)
            times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, (url, response.status_code)
        print(
            f"| {name} | {statistics.median(times):.0f} | {', '.join(f'{t:.0f}' for t in times)} |"
        )
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        detect_drift(version, timezone.now())
        times.append((time.perf_counter() - started) * 1000)
    print(
        f"| drift job (the last 60 min) | {statistics.median(times):.0f} | "
        f"{', '.join(f'{t:.0f}' for t in times)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("writer", "drift", "pages"), required=True)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200_000, help="pages: a day's requests")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    tenant = make_tenant(f"predlog-bench-{os.getpid()}")
    try:
        print(f"database: {django.db.connection.vendor}; {os.cpu_count()} CPUs")
        if args.part == "writer":
            model = make_model(tenant, "writer")
            writer_part(create_version(model, small_onnx()), args.repeat)
        elif args.part == "drift":
            drift_part(tenant, args.repeat)
        else:
            pages_part(tenant, args.requests, args.repeat)
    finally:
        tenant.delete()


if __name__ == "__main__":
    main()
