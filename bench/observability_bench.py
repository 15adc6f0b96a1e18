"""What metrics and prediction logging cost on the full OIP v2 path, measured in one run.

One copy of the serving path per configuration (PostgreSQL + Redis; each a uvicorn server and
its own serving agent):

- **off**: per-request metrics off (``SWITCHYARD_REQUEST_METRICS=0``) and the prediction log
  off (``SWITCHYARD_PREDICTION_LOG=0``);
- **off-again**: the same as off, a control: how far two identical copies differ by chance;
- **metrics**: metrics on, the prediction log off;
- **on**: both on: 10 % of the predictions logged, written to PostgreSQL by the server's
  background writer.

Every copy serves the same model, ``fraud-logged`` (the demo fraud model's artifact as a model
whose log sampling is 10 %), so only the process settings differ.

All servers and agents share CPU 0 (taskset); one wrk per copy, all on CPU 1, load every copy
at the same time, so the machine's drift (on the development VM it moves throughput by ±20 %
from one few-second slice to the next) falls on all of them alike; each copy's throughput and
CPU per request are compared with the "off" copy of the same round. Every round starts fresh
processes, because two processes of the same configuration differ by a few per cent (memory
layout, hash seeds) and one pair of them would bias a whole run. The table gives the median
over rounds and the range. The PostgreSQL server, all of its processes, is pinned to CPU 1 while
the bench runs (in a deployment the database is a machine of its own), its CPU shown apart. The
server's CPU is also split into its event-loop thread and its other threads (the prediction
log's writer among them).

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
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.oip_bench import (  # noqa: E402
    SERVERS,
    _children,
    _ok,
    cpu_seconds,
    own_cpu_seconds,
    run_wrk,
    start_redis,
)
from tests.e2e.harness import PY, Proc, free_port, services_backend, wait_until  # noqa: E402

OFF = {"SWITCHYARD_REQUEST_METRICS": "0", "SWITCHYARD_PREDICTION_LOG": "0"}
CONFIGS = {
    "off": OFF,
    "off-again": OFF,
    "metrics": OFF | {"SWITCHYARD_REQUEST_METRICS": "1"},
    "on": {"SWITCHYARD_REQUEST_METRICS": "1", "SWITCHYARD_PREDICTION_LOG": "1"},
}
MODEL = "fraud-logged"
# The demo model's artifact again as a model logged at 10 %.
SETUP = """
from registry.models import Model
from registry.services import create_version, set_alias
fraud = Model.objects.get(name='fraud-detector')
source = fraud.aliases.get(name='production').version
logged, _ = Model.objects.get_or_create(
    tenant=fraud.tenant, name='fraud-logged', defaults={'task': fraud.task, 'log_sample_rate': 0.1}
)
if not logged.versions.exists():
    with source.artifact.open('rb') as f:
        version = create_version(logged, f.read(), feature_names=source.feature_names)
    set_alias(logged, 'production', version, reason='observability bench')
"""
# How many live agents hold the served version ready (each gateway must serve from its own).
READY_AGENTS = """
from fleet.models import AgentSession
from registry.models import Alias
served = Alias.objects.get(model__name='fraud-logged', name='production').version_id
live = AgentSession.objects.filter(disconnected_at__isnull=True)
print(sum(1 for ready in live.values_list('ready_versions', flat=True) if served in ready))
"""
COUNT_LOGS = (
    "from registry.models import Model; "
    "from monitoring.quality import logged_predictions; "
    "print(logged_predictions(Model.objects.get(name='fraud-logged')).count())"
)


def logs(config: str) -> bool:
    """Whether the configuration has the prediction log on (its writer writes Parquet files)."""
    return CONFIGS[config]["SWITCHYARD_PREDICTION_LOG"] == "1"


class Stack:
    """One configuration's uvicorn server and serving agent, pinned to CPU 0."""

    def __init__(self, config: str, backend, tmp: Path, token: str, round_: int) -> None:
        self.config = config
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**backend.env, "LOG_LEVEL": "WARNING", **CONFIGS[config]}
        server_cmd = SERVERS["uvicorn"].format(port=port).split()
        self.server = Proc(f"uvicorn-{config}", ["taskset", "-c", "0", PY, *server_cmd], env, tmp)
        agent_cmd = f"taskset -c 0 {PY} -m serving_agent --platform {self.url} --token {token} "
        agent_cmd += f"--cache-dir {tmp / f'cache-{config}-{round_}'} --log-level WARNING"
        self.agent = Proc(f"agent-{config}", agent_cmd.split(), env, tmp)
        self.target = f"{self.url}/v2/models/{MODEL}/infer"
        self.logs = logs(config)

    def wait_ready(self, key: str) -> None:
        ready = self.target.removesuffix("/infer") + "/ready"
        wait_until(partial(_ok, ready, {"Authorization": f"Bearer {key}"}), 90, self.agent)

    def cpu(self) -> float:
        return cpu_seconds(self.server.popen.pid) + cpu_seconds(self.agent.popen.pid)

    def threads(self) -> tuple[float, float]:
        """CPU seconds the server's event-loop thread has run, and its other threads (the
        prediction log's writer, the executor's database calls), from /proc's schedstat."""
        main = other = 0.0
        for task in Path(f"/proc/{self.server.popen.pid}/task").iterdir():
            try:
                ran = int((task / "schedstat").read_text().split()[0]) / 1e9
            except (FileNotFoundError, ValueError):
                continue  # a thread that ended meanwhile
            if task.name == str(self.server.popen.pid):
                main += ran
            else:
                other += ran
        return main, other

    def stop(self) -> None:
        self.agent.stop()
        self.server.stop()


def agents_ready(backend, n: int) -> bool:
    return int(backend.shell(READY_AGENTS)) >= n


def together(
    stacks: list[Stack],
    connections: int,
    key: str,
    args,
    round_: int,
    db: Database,
    seconds: int | None = None,
) -> list[dict]:
    """Load every stack at once for ``seconds`` (one wrk each, all on CPU 1), then pause
    ``args.gap`` (longer than the log writer's flush interval, so the records sampled are
    written within the CPU counted); each stack's numbers."""
    seconds = seconds or args.seconds
    db_before = db.pin()
    before = {s.config: s.cpu() for s in stacks}
    threads_before = {s.config: s.threads() for s in stacks}
    with ThreadPoolExecutor(len(stacks)) as pool:
        results = list(
            pool.map(lambda s: run_wrk(s.target, connections, seconds, key, args.body), stacks)
        )
    time.sleep(args.gap)
    db_used = db.used(db_before)
    # The database's work is the logging copies' (the others only send heartbeats).
    logging = sum(r["requests"] for s, r in zip(stacks, results, strict=True) if s.logs) or 1
    rows = []
    for stack, result in zip(stacks, results, strict=True):
        requests = max(result["requests"], 1)
        main, other = (
            (now - then) * 1e6 / requests
            for now, then in zip(stack.threads(), threads_before[stack.config], strict=True)
        )
        rows.append(
            {
                "config": stack.config,
                "connections": connections,
                "round": round_,
                "rps": result["requests"] / (result["duration_us"] / 1e6),
                "p50_ms": result["p50_us"] / 1000,
                "p99_ms": result["p99_us"] / 1000,
                "cpu_ms": (stack.cpu() - before[stack.config]) * 1000 / requests,
                "db_cpu_ms": db_used * 1000 / logging if stack.logs else None,
                "errors": result["errors"],
                "main_us": main,
                "threads_us": other,
            }
        )
    return rows


class Database:
    """The PostgreSQL server, every process of it (backends, WAL writer, autovacuum workers
    forked later), pinned to CPU 1 beside wrk while the bench runs: in a deployment the database
    is a machine of its own, and its work must not land on the gateway's core by chance of
    scheduling. Its CPU is counted apart."""

    def __init__(self, url: str) -> None:
        import psycopg

        with psycopg.connect(url.replace("postgres://", "postgresql://", 1)) as conn:
            data_dir = conn.execute("SHOW data_directory").fetchone()[0]
        self.postmaster = int((Path(data_dir) / "postmaster.pid").read_text().split()[0])

    def processes(self) -> list[int]:
        return [self.postmaster, *_children(self.postmaster)]

    def pin(self, cpus: set[int] | None = None) -> dict[int, float]:
        """Pin the server's processes to ``cpus`` (CPU 1); their CPU seconds now."""
        cpu = {}
        for pid in self.processes():
            try:
                os.sched_setaffinity(pid, cpus or {1})
                cpu[pid] = own_cpu_seconds(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        return cpu

    def unpin(self) -> None:
        self.pin(set(range(os.cpu_count() or 1)))

    def used(self, before: dict[int, float]) -> float:
        """CPU seconds of the server's processes since ``before`` (one started since counts
        whole; one that ended meanwhile is left out)."""
        total = 0.0
        for pid in self.processes():
            try:
                total += own_cpu_seconds(pid) - before.get(pid, 0.0)
            except FileNotFoundError:
                pass
        return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--gap", type=float, default=1.5, help="pause after each measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--connections", default="32", help="per copy")
    parser.add_argument("--configs", default="off,off-again,metrics,on", help="baseline first")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "bench" / "results" / "observability.md"
    )
    args = parser.parse_args()
    features = np.random.default_rng(1).normal(size=32).round(4).tolist()
    args.body = json.dumps(
        {"inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32", "data": features}]}
    )
    connections = [int(c) for c in args.connections.split(",")]
    configs = args.configs.split(",")

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-obs-bench-"))
    redis, redis_port = start_redis()
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    backend = services_backend(tmp)
    backend.env["SWITCHYARD_DEMO_TEXT_SECONDS"] = "1"
    rows: list[dict] = []
    db = None
    try:
        backend.manage("bootstrap_demo")  # writes its credentials to demo.json, 0600
        creds = json.loads((backend.var_dir / "demo.json").read_text())
        backend.shell(SETUP)
        db = Database(backend.env["DATABASE_URL"])
        key = creds["api_key"]
        for round_ in range(args.rounds):
            # Started in a different order each round, so no configuration always goes first.
            shift = round_ % len(configs)
            order = configs[shift:] + configs[:shift]
            stacks = {c: Stack(c, backend, tmp, creds["node_token"], round_) for c in order}
            try:
                for stack in stacks.values():
                    stack.wait_ready(key)
                wait_until(partial(agents_ready, backend, len(stacks)), 120)
                for c in connections:
                    together(list(stacks.values()), c, key, args, round_, db, args.warmup)
                    rows += together(list(stacks.values()), c, key, args, round_, db)
                    for row in rows[-len(stacks) :]:
                        print(json.dumps(row), flush=True)
            finally:
                for stack in stacks.values():
                    stack.stop()
        logged = int(backend.shell(COUNT_LOGS).strip())
    finally:
        if db is not None:
            db.unpin()
        backend.close()
        redis.terminate()
    table = render(rows, connections, configs, args, logged)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)


def render(rows: list[dict], connections: list[int], configs: list[str], args, logged: int) -> str:
    def median(config: str, c: int, field: str) -> float:
        return statistics.median(
            r[field] for r in rows if r["config"] == config and r["connections"] == c
        )

    def db_cpu(config: str, c: int) -> str:
        if not logs(config):
            return "–"
        return f"{median(config, c, 'db_cpu_ms'):.3f}"

    lines = [
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({os.cpu_count()} CPUs): OIP v2, demo fraud MLP, PostgreSQL + Redis, one uvicorn "
        f"server and agent per configuration, all on CPU 0, loaded at once by one wrk each on "
        f"CPU 1 ({', '.join(map(str, connections))} connections per copy); {args.rounds} "
        f"rounds of fresh processes, {args.seconds} s each; medians.",
        "",
        "| connections | config | req/s | p50 ms | p99 ms | server + agent CPU ms/req | "
        "of which event loop µs/req | other server threads µs/req | "
        "PostgreSQL CPU ms/req | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in connections:
        for config in configs:
            errors = sum(
                r["errors"] for r in rows if r["config"] == config and r["connections"] == c
            )
            lines.append(
                f"| {c} | {config} | {median(config, c, 'rps'):,.0f} | "
                f"{median(config, c, 'p50_ms'):.2f} | {median(config, c, 'p99_ms'):.2f} | "
                f"{median(config, c, 'cpu_ms'):.3f} | {median(config, c, 'main_us'):.1f} | "
                f"{median(config, c, 'threads_us'):.1f} | {db_cpu(config, c)} | "
                f"{errors} |"
            )
    lines += [
        "",
        f"Against {configs[0]} in the same round: the median ratio and its range over rounds.",
        "",
        f"| connections | config | throughput vs {configs[0]} | range over rounds | "
        f"server + agent CPU/req vs {configs[0]} |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in connections:
        for config in configs[1:]:
            ratios = paired(rows, configs[0], config, c, "rps")
            ratio = statistics.median(ratios)
            cpu = statistics.median(paired(rows, configs[0], config, c, "cpu_ms"))
            lines.append(
                f"| {c} | {config} | {ratio:.3f} ({(ratio - 1) * 100:+.1f} %) | "
                f"{(min(ratios) - 1) * 100:+.1f} % to {(max(ratios) - 1) * 100:+.1f} % | "
                f"{cpu:.3f} |"
            )
    lines += ["", f"Prediction log rows written during the run: {logged:,}.", ""]
    return "\n".join(lines)


def paired(rows: list[dict], base: str, config: str, c: int, field: str) -> list[float]:
    """``config``'s value over ``base``'s, one ratio per round."""
    by = {(r["config"], r["round"]): r[field] for r in rows if r["connections"] == c}
    rounds = sorted({r["round"] for r in rows})
    return [by[config, n] / by[base, n] for n in rounds if (base, n) in by and (config, n) in by]


if __name__ == "__main__":
    main()
