"""Batch jobs beside live traffic, in one run: a real uvicorn server, serving agent, Celery
worker and beat (the embedded default, or PostgreSQL + Redis with ``--backend services``).

Phases, one after another on the same platform:

1. interactive alone: ``--clients`` closed-loop callers of one-row OIP v2 requests;
2. a job alone: ``--rows`` rows, its rows/s from its start and finish times;
3. the same job again with the interactive callers beside it: both measured;
4. in-process ONNX Runtime (one thread) on the same rows at the job's request size.

Prints one table. Run: ``python bench/batch_bench.py [--rows 20000] [--seconds 10]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.harness import (  # noqa: E402
    create_node,
    create_tenant,
    embedded_backend,
    free_port,
    services_backend,
    start_agent,
    start_celery,
    start_server,
    wait_until,
)
from tests.onnx_models import slow_onnx  # noqa: E402

FEATURES = ["a", "b", "c", "d"]
ONE_ROW = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.3] * 4}]}


def interactive(url: str, key: str, clients: int, stop: threading.Event) -> list[float]:
    """Closed-loop callers until ``stop``: every request's latency in seconds."""
    latencies: list[float] = []
    lock = threading.Lock()

    def caller() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
            while not stop.is_set():
                start = time.perf_counter()
                response = c.post("/v2/models/clf/infer", json=ONE_ROW)
                took = time.perf_counter() - start
                if response.status_code == 200:
                    with lock:
                        latencies.append(took)

    threads = [threading.Thread(target=caller) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def for_seconds(url: str, key: str, clients: int, seconds: float) -> list[float]:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    return interactive(url, key, clients, stop)


def run_job(client: httpx.Client, data: bytes) -> dict:
    files = {"file": ("rows.jsonl", data, "application/x-ndjson")}
    response = client.post("/api/v1/jobs", data={"model": "clf", "format": "jsonl"}, files=files)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    return wait_until(
        lambda: (s := client.get(f"/api/v1/jobs/{job_id}").json())["state"] == "succeeded" and s,
        600,
        interval=0.2,
    )


def job_rate(job: dict) -> float:
    took = datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["started_at"])
    return job["rows_total"] / took.total_seconds()


def pct(latencies: list[float], q: float) -> float:
    return float(np.percentile(latencies, q) * 1000) if latencies else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["embedded", "services"], default="embedded")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--request-rows", type=int, default=100)
    args = parser.parse_args()

    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="sy-batch-bench-"))
    backend = embedded_backend(tmp) if args.backend == "embedded" else services_backend(tmp)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    backend.env.update(
        SWITCHYARD_PLATFORM_URL=url,
        SWITCHYARD_BATCH_CHUNK_ROWS="1000",
        SWITCHYARD_BATCH_REQUEST_ROWS=str(args.request_rows),
        SWITCHYARD_BATCH_IN_FLIGHT="2",
    )
    artifact = slow_onnx(width=256, depth=4)
    procs = [start_server(backend, "uvicorn", port)]
    try:
        procs.append(start_agent(backend, url, create_node(backend, "n")))
        procs += [start_celery(backend, "worker"), start_celery(backend, "beat")]
        key = create_tenant(backend, "alpha", rps=100_000, burst=100_000)
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert client.post("/api/v1/models", json={"name": "clf", "task": "classifier"}).is_success
        files = {"artifact": ("m.onnx", artifact, "application/octet-stream")}
        fields = {"feature_names": json.dumps(FEATURES)}
        made = client.post("/api/v1/models/clf/versions", files=files, data=fields)
        assert made.status_code == 201, made.text
        assert client.put("/api/v1/models/clf/aliases/production", json={"version": 1}).is_success
        wait_until(lambda: client.get("/v2/models/clf/ready").status_code == 200, 60)

        x = np.random.default_rng(0).standard_normal((args.rows, 4)).astype(np.float32)
        data = "".join(
            json.dumps(dict(zip(FEATURES, map(float, r), strict=True))) + "\n" for r in x
        )
        for_seconds(url, key, args.clients, 2)  # warm-up

        alone = for_seconds(url, key, args.clients, args.seconds)
        job_alone = run_job(client, data.encode())

        stop = threading.Event()
        beside: list[float] = []
        callers = threading.Thread(
            target=lambda: beside.extend(interactive(url, key, args.clients, stop))
        )
        callers.start()
        job_beside = run_job(client, data.encode())
        stop.set()
        callers.join()

        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(artifact, options, providers=["CPUExecutionProvider"])
        start = time.perf_counter()
        for i in range(0, args.rows, args.request_rows):
            session.run(None, {"x": x[i : i + args.request_rows]})
        in_process = args.rows / (time.perf_counter() - start)
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()

    print(
        f"\nbatch bench: {args.backend} backend, model 4 -> 256 (x4 tanh) -> 2 ONNX, "
        f"{args.rows} rows, {args.request_rows} rows a request, {args.clients} interactive "
        "callers (closed loop, one row a request)\n"
    )
    print("| case | interactive req/s | interactive p50 ms | interactive p99 ms | job rows/s |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| interactive alone | {len(alone) / args.seconds:,.0f} | {pct(alone, 50):.2f} | "
        f"{pct(alone, 99):.2f} | – |"
    )
    print(f"| job alone | – | – | – | {job_rate(job_alone):,.0f} |")
    took = (
        datetime.fromisoformat(job_beside["finished_at"])
        - datetime.fromisoformat(job_beside["started_at"])
    ).total_seconds()
    print(
        f"| job beside interactive | {len(beside) / took:,.0f} | {pct(beside, 50):.2f} | "
        f"{pct(beside, 99):.2f} | {job_rate(job_beside):,.0f} |"
    )
    print(
        f"| in-process ONNX Runtime, 1 thread, batch {args.request_rows} | – | – | – | "
        f"{in_process:,.0f} |"
    )


if __name__ == "__main__":
    main()
