"""Benchmark cold starts on the local backend: the first request after scale-to-zero, and where
its time goes.

Platform on the embedded default: uvicorn, Celery worker and beat pinned to CPU 0 (the agent
replicas the worker starts inherit it); this client on CPU 1. A deployment of 0-1 replicas that
scales to zero after 2 idle seconds. Each round waits until no replica runs, then times one
request (held by the gateway while the replica starts), then one warm request. Stages, from
the database: the wake until the autoscaler's accepted scale-up, the accepted scale-up until
the replica's websocket connected, and from there until the answer (download, load, warm-up,
first inference). Run: ``.venv/bin/python bench/cold_start_bench.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.conftest import upload_and_promote  # noqa: E402
from tests.e2e.harness import (  # noqa: E402
    PY,
    Proc,
    answers,
    create_tenant,
    embedded_backend,
    free_port,
    wait_until,
)
from tests.onnx_models import slow_onnx, small_onnx  # noqa: E402

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1] * 4}]}
DEPLOY = """
from registry.models import Model
from fleet.models import Deployment, Pool
pool, _ = Pool.objects.get_or_create(name="local", defaults={{"backend": "local"}})
version = Model.objects.get(name="{name}").versions.get(version=1)
Deployment.objects.create(
    tenant=version.model.tenant, version=version, pool=pool, min_replicas=0, max_replicas=1,
    scale_down_window_s=2, idle_to_zero_s=2,
)
"""
STAGES = """
import json
from fleet.models import AgentSession
from fleet.models import Deployment
d = Deployment.objects.get(version__model__name="{name}")
up = d.decisions.filter(accepted=1, current=0).order_by("-created_at").first()
s = AgentSession.objects.filter(deployment=d).order_by("-connected_at").first()
print(json.dumps({{"woken": d.woken_at.timestamp(), "scaled": up.created_at.timestamp(),
                  "connected": s.connected_at.timestamp(), "desired": d.desired_replicas}}))
"""
DESIRED = """
from fleet.models import Deployment
print(Deployment.objects.get(version__model__name="{name}").desired_replicas)
"""


def pinned(args: list[str]) -> list[str]:
    return ["taskset", "-c", "0", *args]


def running_replicas(agents: Path) -> int:
    count = 0
    for pid_file in agents.glob("sy-agent-*/replica-*.pid"):
        try:
            os.kill(int(pid_file.read_text()), 0)
            count += 1
        except (ValueError, OSError):
            pass
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.sched_setaffinity(0, {1})
    tmp = Path(tempfile.mkdtemp(prefix="sy-cold-"))
    backend = embedded_backend(tmp)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agents = tmp / "agents"
    backend.env.update(
        SWITCHYARD_AUTOSCALE_INTERVAL_S="0.5",
        SWITCHYARD_AGENT_HEARTBEAT_S="1",
        SWITCHYARD_PLATFORM_URL=url,
        SWITCHYARD_LOCAL_AGENTS_DIR=str(agents),
        LOG_LEVEL="WARNING",
    )
    uvicorn = [PY, "-m", "uvicorn", "platform_site.asgi:application", "--port", str(port)]
    procs = [Proc("uvicorn", pinned([*uvicorn, "--no-access-log"]), backend.env, tmp)]
    try:
        wait_until(lambda: answers(url), 30, procs[0])
        key = create_tenant(backend, "bench")
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        models = {"small": small_onnx(), "slow": slow_onnx(depth=96)}
        for name, artifact in models.items():
            upload_and_promote(client, name, artifact)
            backend.shell(DEPLOY.format(name=name))
        celery = [PY, "-m", "celery", "-A", "platform_site"]
        worker = [*celery, "worker", "--pool", "solo"]
        procs.append(Proc("worker", pinned(worker), backend.env, tmp))
        beat = [*celery, "beat", "--schedule", str(tmp / "beat-schedule")]
        procs.append(Proc("beat", pinned(beat), backend.env, tmp))

        rows = []
        for name, artifact in models.items():
            cold, warm, to_scale, to_connect, to_answer = [], [], [], [], []
            for _ in range(args.rounds):
                check = DESIRED.format(name=name)
                wait_until(lambda q=check: backend.shell(q).strip() == "0", 60)
                wait_until(lambda: running_replicas(agents) == 0, 30)
                started = time.time()
                response = client.post(f"/v2/models/{name}/infer", json=BODY)
                answered = time.time()
                assert response.status_code == 200, response.text
                t0 = time.perf_counter()
                assert client.post(f"/v2/models/{name}/infer", json=BODY).status_code == 200
                warm.append(time.perf_counter() - t0)
                stages = json.loads(backend.shell(STAGES.format(name=name)).splitlines()[-1])
                cold.append(answered - started)
                to_scale.append(stages["scaled"] - started)
                to_connect.append(stages["connected"] - stages["scaled"])
                to_answer.append(answered - stages["connected"])
            rows.append(
                (name, len(artifact), cold, warm, to_scale, to_connect, to_answer),
            )
        print(f"\n{datetime.date.today()} · {platform.node()} · {args.rounds} rounds per model\n")
        print(
            "| model | artifact | cold request p50 s | max s | request → scale-up s "
            "| → replica connected s | → answered s | warm request p50 ms |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, size, cold, warm, scale, connect, answer in rows:
            med = statistics.median
            print(
                f"| {name} | {size / 1024:,.1f} KiB | {med(cold):.2f} | {max(cold):.2f} "
                f"| {med(scale):.2f} | {med(connect):.2f} | {med(answer):.2f} "
                f"| {med(warm) * 1000:.1f} |"
            )
    finally:
        for proc in reversed(procs):
            proc.stop()
        for pid_file in agents.glob("sy-agent-*/replica-*.pid"):
            try:
                os.killpg(int(pid_file.read_text()), 9)
            except (ValueError, OSError):
                pass
        backend.close()


if __name__ == "__main__":
    main()
