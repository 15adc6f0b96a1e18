"""The platform at rest: CPU per second of each process with no traffic (issue 33: at most 5 ms
per second for the web process and the agent, beat and worker reported apart).

For each backend (the embedded default, then PostgreSQL + Redis when reachable) it starts what
``make up`` runs: uvicorn, one agent serving one ONNX version, a Celery worker and Celery beat.
It uploads and promotes the model, waits until the agent serves it, lets start-up work settle,
then reads each process's CPU time (``/proc``, its children included) over ``--seconds`` with
nothing sent. ``--spy`` adds, per process, the functions py-spy finds running in that window
(what still wakes up). Run: ``.venv/bin/python bench/idle_bench.py``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from oip_bench import cpu_seconds  # noqa: E402

from tests.e2e.harness import (  # noqa: E402
    Proc,
    create_node,
    create_tenant,
    embedded_backend,
    free_port,
    services_available,
    services_backend,
    start_agent,
    start_celery,
    start_server,
    wait_until,
)
from tests.onnx_models import small_onnx  # noqa: E402

TARGET_MS_PER_S = 5.0  # the web process and the agent (issue 33)


def start_platform(backend_name: str, tmp: Path):
    backend = (services_backend if backend_name == "services" else embedded_backend)(tmp)
    backend.env["LOG_LEVEL"] = "WARNING"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    web = start_server(backend, "uvicorn", port)
    token = create_node(backend, "node-1")
    agent = start_agent(backend, url, token)
    worker = start_celery(backend, "worker")
    beat = start_celery(backend, "beat")
    key = create_tenant(backend, "idle")
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as api:
        assert api.post("/api/v1/models", json={"name": "m", "task": "classifier"}).is_success
        files = {"artifact": ("m.onnx", small_onnx(), "application/octet-stream")}
        assert api.post("/api/v1/models/m/versions", files=files).is_success
        assert api.put("/api/v1/models/m/aliases/production", json={"version": 1}).is_success
        wait_until(lambda: api.get("/v2/models/m/ready").status_code == 200, 60, agent)
        # One request, so the warm path has run once as after real traffic.
        body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]}
        assert api.post("/v2/models/m/infer", json=body).status_code == 200
    return backend, {"web": web, "agent": agent, "worker": worker, "beat": beat}


def spy(procs: dict[str, Proc], seconds: int, tmp: Path) -> dict[str, Counter[str]]:
    """py-spy on each process for ``seconds``: samples per innermost Python function."""
    spies, outs = {}, {}
    for name, proc in procs.items():
        outs[name] = tmp / f"{name}.raw"
        cmd = [str(ROOT / ".venv/bin/py-spy"), "record", "--pid", str(proc.popen.pid)]
        cmd += ["--rate", "100", "--duration", str(seconds), "--format", "raw", "--nonblocking"]
        cmd += ["--subprocesses", "--output", str(outs[name])]
        spies[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found = {}
    for name, process in spies.items():
        process.wait(timeout=seconds + 60)
        counts: Counter[str] = Counter()
        text = outs[name].read_text() if outs[name].exists() else ""
        for line in text.splitlines():
            stack, _, n = line.rpartition(" ")
            counts[stack.split(";")[-1]] += int(n)
        found[name] = counts
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--settle", type=int, default=15, help="seconds after start-up, unread")
    parser.add_argument("--backends", default="embedded,services")
    parser.add_argument("--spy", action="store_true")
    args = parser.parse_args()
    rows = []
    for backend_name in args.backends.split(","):
        if backend_name == "services" and not services_available():
            print("PostgreSQL/Redis not reachable: services skipped")
            continue
        tmp = Path(tempfile.mkdtemp(prefix="switchyard-idle-"))
        backend, procs = start_platform(backend_name, tmp)
        try:
            time.sleep(args.settle)
            if args.spy:
                spied = spy(procs, args.seconds, tmp)
            before = {n: cpu_seconds(p.popen.pid) for n, p in procs.items()}
            t0 = time.monotonic()
            time.sleep(args.seconds)
            elapsed = time.monotonic() - t0
            for name, proc in procs.items():
                used = cpu_seconds(proc.popen.pid) - before[name]
                rows.append((backend_name, name, used * 1000 / elapsed))
            if args.spy:
                for name, counts in spied.items():
                    print(f"{backend_name} {name}: {sum(counts.values())} samples")
                    for frame, n in counts.most_common(8):
                        print(f"  {n:5d}  {frame}")
        finally:
            for proc in procs.values():
                proc.stop()
            backend.close()
    print(
        f"\nRun {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({os.cpu_count()} CPUs), {args.seconds} s with no traffic after {args.settle} s of "
        "settling:\n"
    )
    print("| backend | process | CPU ms per second | target |")
    print("| --- | --- | --- | --- |")
    for backend_name, name, ms in rows:
        target = f"≤ {TARGET_MS_PER_S:g}" if name in ("web", "agent") else "reported"
        print(f"| {backend_name} | {name} | {ms:.1f} | {target} |")


if __name__ == "__main__":
    main()
