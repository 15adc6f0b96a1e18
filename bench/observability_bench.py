"""What metrics and prediction logging cost on the full OIP v2 path, measured in one run.

Two configurations of the same platform (PostgreSQL + Redis, uvicorn, one agent, the demo
fraud model), measured in alternation so that drift of a shared machine hits both alike:

- **off**: per-request metrics off (``SWITCHYARD_REQUEST_METRICS=0``), prediction log sampling 0;
- **on**: metrics on, the model's prediction log sampling at 10 % (written to PostgreSQL by the
  server's background writer).

Server-side processes are pinned to CPU 0 with taskset, wrk to CPU 1 (as ``oip_bench.py``).
Each round starts fresh processes per configuration, warms up, then measures; the table has the
median over rounds of requests/s, p50/p99 and server CPU per request, and the on/off ratio.
Run: ``.venv/bin/python bench/observability_bench.py`` (needs wrk, PostgreSQL, redis-server).
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
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.oip_bench import SERVERS, _ok, cpu_seconds, run_wrk, start_redis  # noqa: E402
from tests.e2e.harness import PY, Proc, free_port, services_backend, wait_until  # noqa: E402

CONFIGS = {
    "off": {"env": {"SWITCHYARD_REQUEST_METRICS": "0"}, "sample": 0.0},
    "metrics": {"env": {"SWITCHYARD_REQUEST_METRICS": "1"}, "sample": 0.0},
    "on": {"env": {"SWITCHYARD_REQUEST_METRICS": "1"}, "sample": 0.1},
}
SET_SAMPLE = (
    "from registry.models import Model; "
    "Model.objects.filter(name='fraud-detector').update(log_sample_rate={rate})"
)
COUNT_LOGS = (
    "from gateway.models import PredictionLog; "
    "print(PredictionLog.objects.filter(model__name='fraud-detector').count())"
)


def measure(backend, tmp, token: str, key: str, config: str, connections: list[int], args):
    """Start server + agent in one configuration, warm up, measure each connection count."""
    backend.shell(SET_SAMPLE.format(rate=CONFIGS[config]["sample"]))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**backend.env, "LOG_LEVEL": "WARNING", **CONFIGS[config]["env"]}
    server = Proc(
        "uvicorn",
        ["taskset", "-c", "0", PY, *SERVERS["uvicorn"].format(port=port).split()],
        env,
        tmp,
    )
    agent_cmd = f"taskset -c 0 {PY} -m serving_agent --platform {url} --token {token} "
    agent_cmd += f"--cache-dir {tmp / 'cache'} --log-level WARNING"
    agent = Proc("agent", agent_cmd.split(), env, tmp)
    rows = []
    try:
        headers = {"Authorization": f"Bearer {key}"}
        wait_until(partial(_ok, f"{url}/v2/models/fraud-detector/ready", headers), 60, agent)
        target = f"{url}/v2/models/fraud-detector/infer"
        for c in connections:
            run_wrk(target, c, args.warmup, key, args.body)
            pids = [server.popen.pid, agent.popen.pid]
            before = sum(cpu_seconds(p) for p in pids)
            result = run_wrk(target, c, args.seconds, key, args.body)
            used = sum(cpu_seconds(p) for p in pids) - before
            seconds = result["duration_us"] / 1e6
            rows.append(
                {
                    "config": config,
                    "connections": c,
                    "rps": result["requests"] / seconds,
                    "p50_ms": result["p50_us"] / 1000,
                    "p99_ms": result["p99_us"] / 1000,
                    "cpu_ms": used * 1000 / max(result["requests"], 1),
                    "errors": result["errors"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        agent.stop()
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", default="16,64")
    parser.add_argument("--configs", default="off,on", help="off, metrics (no log), on")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "bench" / "results" / "observability.md"
    )
    args = parser.parse_args()
    features = np.random.default_rng(1).normal(size=32).round(4).tolist()
    args.body = json.dumps(
        {"inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32", "data": features}]}
    )
    connections = [int(c) for c in args.connections.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-obs-bench-"))
    redis, redis_port = start_redis()
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    backend = services_backend(tmp)
    backend.env["SWITCHYARD_DEMO_TEXT_SECONDS"] = "1"
    rows: list[dict] = []
    try:
        creds = json.loads(backend.manage("bootstrap_demo").strip().splitlines()[-1])
        configs = args.configs.split(",")
        for _ in range(args.rounds):
            for config in configs:
                rows += measure(
                    backend, tmp, creds["node_token"], creds["api_key"], config, connections, args
                )
        logged = int(backend.shell(COUNT_LOGS).strip())
    finally:
        backend.close()
        redis.terminate()
    table = render(rows, connections, configs, args.rounds, logged)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)


def render(
    rows: list[dict], connections: list[int], configs: list[str], rounds: int, logged: int
) -> str:
    def median(config: str, c: int, field: str) -> float:
        return statistics.median(
            r[field] for r in rows if r["config"] == config and r["connections"] == c
        )

    lines = [
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({os.cpu_count()} CPUs): OIP v2, demo fraud MLP, PostgreSQL + Redis, uvicorn and the "
        f"agent on CPU 0, wrk on CPU 1; medians of {rounds} alternating rounds.",
        "",
        "| connections | config | req/s | p50 ms | p99 ms | server CPU ms/req | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in connections:
        for config in configs:
            errors = sum(
                r["errors"] for r in rows if r["config"] == config and r["connections"] == c
            )
            lines.append(
                f"| {c} | {config} | {median(config, c, 'rps'):,.0f} | "
                f"{median(config, c, 'p50_ms'):.2f} | {median(config, c, 'p99_ms'):.2f} | "
                f"{median(config, c, 'cpu_ms'):.3f} | {errors} |"
            )
    lines += ["", "| connections | config | throughput vs off | CPU per request vs off |"]
    lines += ["| --- | --- | --- | --- |"]
    for c in connections:
        for config in configs[1:]:
            ratio = median(config, c, "rps") / median(configs[0], c, "rps")
            cpu = median(config, c, "cpu_ms") / median(configs[0], c, "cpu_ms")
            lines.append(
                f"| {c} | {config} | {ratio:.3f} ({(ratio - 1) * 100:+.1f} %) | {cpu:.3f} |"
            )
    lines += ["", f"Prediction log rows written during the run: {logged:,}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
