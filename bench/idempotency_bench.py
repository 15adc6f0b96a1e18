"""What an ``Idempotency-Key`` costs on OIP v2 infer: a real uvicorn server and serving agent
(pinned to CPU 0), closed-loop clients on CPU 1, three kinds of requests in turn:

- ``none``: no header (what every request paid before, and still pays);
- ``new key``: a fresh key per request: the claim, then the answer kept (in process on the
  embedded default; in Redis with ``--backend services``, whose CPU is counted too);
- ``retry``: the same key each time: the first answer given again, the agent not reached.

It prints req/s, p50/p99 and the server-side CPU per request (server, agent and Redis processes
over the requests answered). Run: ``python bench/idempotency_bench.py [--backend services]``.
On a busy machine those differences drown in noise, so ``--micro`` measures the store alone, in
process: the CPU of one claim and one kept answer (a new key), and of one replay, in process and
against Redis (``REDIS_URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oip_bench import cpu_seconds, start_redis  # noqa: E402

from tests.e2e.harness import (  # noqa: E402
    PY,
    Proc,
    create_node,
    create_tenant,
    embedded_backend,
    free_port,
    services_backend,
    wait_until,
)
from tests.onnx_models import small_onnx  # noqa: E402

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.3] * 4}]}
MODES = ("none", "new key", "retry")


async def load(url: str, key: str, mode: str, clients: int, seconds: float) -> dict:
    """Closed-loop clients for ``seconds``: (requests, errors, p50, p99 in ms)."""
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds
    auth = {"Authorization": f"Bearer {key}"}
    body = json.dumps(BODY).encode()
    limits = httpx.Limits(max_connections=clients)

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while time.monotonic() < stop:
            headers = dict(auth)
            if mode == "new key":
                headers["Idempotency-Key"] = uuid.uuid4().hex
            elif mode == "retry":
                headers["Idempotency-Key"] = "bench-retry"
            started = time.perf_counter()
            response = await client.post("/v2/models/clf/infer", content=body, headers=headers)
            latencies.append(time.perf_counter() - started)
            errors += response.status_code != 200

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    ms = np.array(latencies) * 1000
    return {
        "requests": len(latencies),
        "errors": errors,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def micro(n: int = 20_000) -> None:
    """µs of CPU per request for the store's work alone (no HTTP, no agent)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")
    import django

    django.setup()
    from gateway import idempotency

    body = json.dumps(BODY).encode()
    stores: list[tuple[str, idempotency.AnswerStore]] = [
        ("in process", idempotency.LocalAnswers(86400, 15, 64 * 1024 * 1024))
    ]
    if os.environ.get("REDIS_URL"):
        local = idempotency.LocalAnswers(86400, 15, 64 * 1024 * 1024)
        stores.append(("Redis", idempotency.RedisAnswers(os.environ["REDIS_URL"], local)))
    answer = b'{"outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}'

    async def run(store: idempotency.AnswerStore, replay: bool) -> float:
        keys = ["replayed"] * n if replay else [uuid.uuid4().hex for _ in range(n)]
        if replay:
            first = await idempotency.claim(store, 0, 0, "replayed", "POST", "/p", body)
            assert first is not None
            await first.keep(200, [], answer)
        started = time.process_time()
        for key in keys:
            claim = await idempotency.claim(store, 0, 0, key, "POST", "/p", body)
            assert claim is not None
            if claim.replay is None:
                await claim.keep(200, [], answer)
        return (time.process_time() - started) * 1e6 / n

    print("\n| store | new key: claim + keep, µs CPU/req | retry: replay, µs CPU/req |")
    print("| --- | --- | --- |")

    async def both(store: idempotency.AnswerStore) -> tuple[float, float]:
        return await run(store, False), await run(store, True)  # one loop: Redis's client

    for name, store in stores:
        fresh, again = asyncio.run(both(store))
        print(f"| {name} | {fresh:.1f} | {again:.1f} |")
    if os.environ.get("REDIS_URL"):  # tenant 0 is the bench's own: leave no keys behind
        import redis

        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        for name in client.scan_iter(idempotency.REDIS_PREFIX + "0:0:*", count=1000):
            client.delete(name)
        client.delete(idempotency.BUDGET_PREFIX + "0")  # its byte count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["embedded", "services"], default="embedded")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--rounds", type=int, default=2, help="each mode this many times, in turn")
    parser.add_argument("--micro", action="store_true", help="the store alone, in process")
    args = parser.parse_args()
    if args.micro:
        micro()
        return
    if os.sched_getaffinity(0) != {1}:  # the clients on CPU 1, away from the server
        os.execvp("taskset", ["taskset", "-c", "1", PY, *sys.argv])

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-idem-bench-"))
    pids: list[int] = []
    redis: subprocess.Popen | None = None
    if args.backend == "services":
        redis, port = start_redis()
        os.environ["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
        backend = services_backend(tmp)
        pids.append(redis.pid)
    else:
        backend = embedded_backend(tmp)
    procs: list[Proc] = []
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**backend.env, "LOG_LEVEL": "WARNING", "SWITCHYARD_GRPC_PORT": "0"}
        server_cmd = ["taskset", "-c", "0", PY, "-m", "uvicorn", "platform_site.asgi:application"]
        server_cmd += ["--port", str(port), "--log-level", "warning", "--no-access-log"]
        procs.append(Proc("uvicorn", server_cmd, env, tmp))
        wait_until(lambda: _answers(url), 60, procs[0])
        key = create_tenant(backend, "bench", rps=1e6, burst=2_000_000)
        token = create_node(backend, "n")
        agent_cmd = ["taskset", "-c", "0", PY, "-m", "serving_agent", "--platform", url]
        agent_cmd += ["--token", token, "--cache-dir", str(tmp / "cache")]
        procs.append(Proc("agent", [*agent_cmd, "--log-level", "WARNING"], env, tmp))
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
            c.post("/api/v1/models", json={"name": "clf", "task": "classifier"})
            files = {"artifact": ("m.onnx", small_onnx(), "application/octet-stream")}
            c.post("/api/v1/models/clf/versions", files=files)
            c.put("/api/v1/models/clf/aliases/production", json={"version": 1})
            wait_until(lambda: c.get("/v2/models/clf/ready").status_code == 200, 60, procs[1])
        pids += [p.popen.pid for p in procs]
        rows: dict[tuple[str, int], list[dict]] = {}
        for clients in (int(n) for n in args.clients.split(",")):
            asyncio.run(load(url, key, "none", clients, 2))  # warm-up
            for _ in range(args.rounds):
                for mode in MODES:
                    before = sum(cpu_seconds(p) for p in pids)
                    result = asyncio.run(load(url, key, mode, clients, args.seconds))
                    used = sum(cpu_seconds(p) for p in pids) - before
                    result["cpu_ms_per_req"] = used * 1000 / max(result["requests"], 1)
                    rows.setdefault((mode, clients), []).append(result)
        print(f"\nOIP v2 infer, {args.backend} backend, median of {args.rounds} rounds")
        print("| requests | clients | req/s | p50 ms | p99 ms | errors | server CPU ms/req |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for (mode, clients), runs in rows.items():
            med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
            print(
                f"| {mode} | {clients} | {med['requests'] / args.seconds:,.0f} | "
                f"{med['p50_ms']:.2f} | {med['p99_ms']:.2f} | {int(med['errors'])} | "
                f"{med['cpu_ms_per_req']:.3f} |"
            )
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()
        if redis is not None:
            redis.terminate()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/v2/health/live", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
