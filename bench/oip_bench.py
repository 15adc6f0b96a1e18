"""Benchmark the full OIP v2 path: wrk → ASGI server → agent → back, on PostgreSQL + Redis.

Every server-side process (ASGI server, serving agent, a Redis of its own) is pinned to CPU 0
with taskset and wrk to CPU 1. For each server (uvicorn, daphne) and 1/16/64 connections: 5 s of
warm-up, then a measured run; it prints requests/s, p50/p99 and the server-side CPU per request
(CPU time of the server processes over the requests served), next to ONNX Runtime called
in-process on the same model in the same run. ``--peers kserve,torchserve[,mlserver]`` adds peer
model servers from PyPI serving the same ONNX file (``bench/peers_bench.py``), measured by the
same ``measure()``. Run: ``make bench`` (or ``bash bench/run.sh``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import stages  # noqa: E402
from peers_bench import PEERS, VENV_OF, ensure_venv, start_peer  # noqa: E402

from tests.e2e.harness import (  # noqa: E402
    PY,
    Proc,
    dispatched,
    free_port,
    services_backend,
    wait_until,
)
from tests.otlp_receiver import Receiver, otlp_receiver  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User+system CPU of a process and its children that are still running."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            total += own_cpu_seconds(p)
        except (FileNotFoundError, IndexError):
            pass
    return total


def own_cpu_seconds(pid: int) -> float:
    """User+system CPU of one process, without its children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _children(k)]


def run_wrk(url: str, connections: int, seconds: int, key: str, body: str) -> dict:
    env = {**os.environ, "BENCH_KEY": key, "BENCH_BODY": body}
    args = [
        "taskset",
        "-c",
        "1",
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{seconds}s",
        "-s",
        str(ROOT / "bench" / "infer.lua"),
        url,
    ]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=seconds + 30)
    line = next(x for x in out.stdout.splitlines() if x.startswith("BENCH "))
    return json.loads(line[6:])


def measure(
    label: str,
    load: Callable[[int, int], dict],
    pids: list[int],
    args: argparse.Namespace,
    profile: list[tuple[int, Path]] | None = None,
) -> list[dict]:
    """One row per connection count, measured the same way for every case and peer: a full-length
    unmeasured run at 1 connection first (the first 1-connection point after a start ran slow),
    then at each count a warm-up and a measured run, with the CPU of ``pids`` and their children
    over it. ``load(connections, seconds)`` runs the load generator (wrk, or grpc_load.py).
    ``profile`` (the gateway's and the agent's pid and sampler output, both run under
    ``bench/cpu_sampler.py``) samples both during each measured run and prints their CPU per
    request by stage (``bench/stages.py``)."""
    load(1, args.seconds)
    rows = []
    for connections in (int(c) for c in args.connections.split(",")):
        load(connections, args.warmup)
        for pid, _ in profile or []:
            os.kill(pid, signal.SIGUSR1)  # start sampling
        before_each = [cpu_seconds(p) for p in pids]
        result = load(connections, args.seconds)
        used_each = [cpu_seconds(p) - b for p, b in zip(pids, before_each, strict=True)]
        used = sum(used_each)
        seconds = result["duration_us"] / 1e6
        if not result["requests"]:
            _stacks_of_a_silent_server(label, connections, pids)
        if profile is not None:
            print(_stage_table(label, connections, result["requests"], pids, used_each, profile))
        rows.append(
            {
                "case": label,
                "connections": connections,
                "rps": result["requests"] / seconds,
                "p50_ms": result["p50_us"] / 1000,
                "p99_ms": result["p99_us"] / 1000,
                "errors": result["errors"],
                "cpu_ms_per_req": used * 1000 / max(result["requests"], 1),
            }
        )
        print(_row(rows[-1]), flush=True)
    return rows


def _stage_table(
    label: str,
    connections: int,
    requests: int,
    pids: list[int],
    used_each: list[float],
    profile: list[tuple[int, Path]],
) -> str:
    """Stop both samplers (their second SIGUSR1 writes the samples) and tabulate by stage."""
    raws = []
    for pid, out in profile:
        out.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR1)
    for _, out in profile:
        wait_until(out.exists, 30)
        time.sleep(0.2)  # written in one go, but give the writer its close
        raws.append(out.read_text())
    per_req = {p: u * 1000 / max(requests, 1) for p, u in zip(pids, used_each, strict=True)}
    (gateway, _), (agent, _) = profile
    return stages.table(
        f"{label}, {connections} connections",
        requests,
        stages.gateway_stages(raws[0]),
        per_req[gateway],
        stages.agent_stages(raws[1]),
        per_req[agent],
    )


def wrk_load(url: str, key: str, body: str) -> Callable[[int, int], dict]:
    return lambda connections, seconds: run_wrk(url, connections, seconds, key, body)


def grpc_streams(address: str, key: str) -> Callable[[int, int], dict]:
    """bench/grpc_load.py on CPU 1 (as wrk): ``connections`` concurrent gRPC streams."""

    def load(connections: int, seconds: int) -> dict:
        args = ["taskset", "-c", "1", PY, str(ROOT / "bench" / "grpc_load.py")]
        args += ["--address", address, "--key", key]
        args += ["--concurrency", str(connections), "--seconds", str(seconds)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60)
        line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
        if line is None:
            raise RuntimeError(f"grpc_load.py failed:\n{out.stdout}\n{out.stderr}")
        return json.loads(line[6:])

    return load


def in_process_onnx(artifact: bytes, seconds: float = 3.0) -> tuple[float, float]:
    """ONNX Runtime called directly, one thread: (batch-1 requests/s, batch-64 items/s)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(artifact, opts, providers=["CPUExecutionProvider"])
    rates = []
    for batch in (1, 64):
        x = np.random.default_rng(0).normal(size=(batch, 32)).astype(np.float32)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            session.run(None, {"features": x})
            count += 1
        rates.append(count * batch / (time.perf_counter() - start))
    return rates[0], rates[1]


# id -> (label, server, path, hop, workers): the OIP v2 path under both servers and over gRPC
# (bench/grpc_load.py instead of wrk, same model and CPUs), the DRF
# prediction API, two gateway processes (``uvicorn --workers 2``, the agent holding a data link to
# each), and the Redis hop: a second uvicorn process that holds no agent (data links off) takes
# the load, so every request crosses the Redis channel layer to the process holding the agent.
CASES = {
    "uvicorn": ("uvicorn", "uvicorn", "oip", False, 1),
    "workers2": ("uvicorn --workers 2", "uvicorn", "oip", False, 2),
    "daphne": ("daphne", "daphne", "oip", False, 1),
    "drf": ("uvicorn, DRF prediction API", "uvicorn", "predict", False, 1),
    "redis-hop": ("uvicorn, via Redis to another process", "uvicorn", "oip", True, 1),
    "canary": ("uvicorn, canary plan 50/50", "uvicorn", "oip", False, 1),
    "grpc": ("uvicorn, OIP v2 over gRPC", "uvicorn", "grpc", False, 1),
}
# OpenTelemetry spans (docs/observability.md, "Traces") at a share of fresh traces, sent over
# OTLP/gRPC to a receiver in this process (its CPU is not the server's): the server and the
# agent pay for recording and encoding theirs.
SPAN_RATIOS = {"spans0": "0", "spans10": "0.1", "spans100": "1"}
for _case, _ratio in SPAN_RATIOS.items():
    CASES[_case] = (f"uvicorn, spans at {float(_ratio):.0%}", "uvicorn", "oip", False, 1)
# Registers the demo artifact again as version 2 and starts a 50 % canary towards it.
START_CANARY = """
from registry.models import Model
from registry.services import create_version
from rollouts.actions import start_plan
from rollouts.models import RolloutPolicy
from tenants.audit import Actor
model = Model.objects.get(name="fraud-detector")
# The rollout policy bounds a canary's weight without approval (10 % by default).
RolloutPolicy.objects.create(tenant=model.tenant, max_weight_without_approval=50)
v1 = model.versions.get(version=1)
v2 = create_version(model, v1.artifact.read(), feature_names=v1.feature_names)
start_plan(model, "canary", v2, {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5,
           "min_samples": 100}, Actor(None, "bench"), weight=50)
"""
SERVERS = {
    "uvicorn": "-m platform_site.serve platform_site.asgi:application "
    "--host 127.0.0.1 --port {port} "
    "--no-access-log --log-level warning --http gateway.http_bounds:BoundedHttpProtocol",
    "daphne": "-m daphne -b 127.0.0.1 -p {port} -v 0 platform_site.asgi:application",
}


def start_redis() -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = f"taskset -c 0 redis-server --port {port} --bind 127.0.0.1 --appendonly no --save"
    proc = subprocess.Popen([*cmd.split(), ""], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--connections", default="1,16,64")
    parser.add_argument(
        "--cases",
        # The spans cases only when asked for: they measure tracing, not the platform.
        default=",".join(c for c in CASES if c not in SPAN_RATIOS),
        help="comma-separated case ids",
    )
    parser.add_argument(
        "--peers",
        default="",
        help=f"comma-separated peer model servers to add ({','.join(PEERS)}), same ONNX file",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "latest.md")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the gateway and the agent under bench/cpu_sampler.py and print their CPU per "
        "request by stage for each measured run (bench/stages.py)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every case and peer this many times, in turn (paired rounds: each "
        "round's rows come from minutes apart), then print medians and per-round ratios",
    )
    parser.add_argument(
        "--baseline",
        default="",
        help="a git revision whose tree (checked out in a temporary worktree) runs the same "
        "cases beside the working tree's, in the same rounds: an A/B of a change",
    )
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    for venv in sorted({VENV_OF[p] for p in peers}):  # pip, if needed, before anything starts
        ensure_venv(venv)

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-bench-"))
    redis, redis_port = start_redis()
    atexit.register(redis.terminate)  # also when the set-up below fails
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    trees = [("", ROOT)]
    if args.baseline:
        trees.append((f" @{args.baseline}", _worktree(args.baseline, tmp)))
    backend = services_backend(tmp)
    backend.env["SWITCHYARD_DEMO_TEXT_SECONDS"] = "1"  # the text model plays no part here
    # Training the demo model takes minutes on a busy machine, past manage()'s default.
    backend.manage("bootstrap_demo", timeout=900)  # writes its credentials to demo.json, 0600
    creds = json.loads((backend.var_dir / "demo.json").read_text())
    artifact = backend.shell(
        "from registry.models import ModelVersion;"
        "print(ModelVersion.objects.get(model__name='fraud-detector').artifact.path)"
    ).strip()
    bench = Bench(args, backend, tmp, redis, creds["api_key"], creds["node_token"])
    rows: list[dict] = []
    try:
        for round_ in range(args.rounds):
            # Trees take turns going first: a fixed order put the working tree, every round,
            # right after the previous round's peers (its ratios leaned the same way at one
            # connection, where a change had nothing to act on).
            in_turn = trees if round_ % 2 == 0 else trees[::-1]
            for case in (c for c in args.cases.split(",") if c):
                for suffix, tree in in_turn:
                    rows += bench.switchyard(case, tree, suffix, round_)
            for name in peers:  # the same ONNX file, body, pinning and measure()
                peer = start_peer(name, Path(artifact), tmp, BODIES["oip"])
                bench.running[:] = peer.procs
                load = wrk_load(peer.url, "", BODIES["oip"])
                rows += _in_round(measure(peer.label, load, peer.pids(), args), round_)
                peer.stop()
        single, batched = in_process_onnx(Path(artifact).read_bytes())
    finally:
        for proc in bench.running:
            proc.stop()
        bench.exits.close()
        backend.close()
        redis.terminate()
        for _, tree in trees[1:]:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    table = _table(rows, single, batched) + "".join(f"\n{n}\n" for n in bench.notes)
    if args.rounds > 1:
        table += "\n" + _medians(rows, [suffix for suffix, _ in trees[1:]])
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)


FEATURES = np.random.default_rng(1).normal(size=32).round(4).tolist()
BODIES = {
    "oip": json.dumps(
        {"inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32", "data": FEATURES}]}
    ),
    "predict": json.dumps({"instances": [FEATURES]}),
}
PATHS = {
    "oip": "/v2/models/fraud-detector/infer",
    "predict": "/api/v1/models/fraud-detector/predict",
}


class Bench:
    """One run's shared parts: the backend with the demo, the Redis, the processes running."""

    def __init__(
        self,
        args: argparse.Namespace,
        backend: Any,
        tmp: Path,
        redis: subprocess.Popen,
        key: str,
        token: str,
    ) -> None:
        self.args, self.backend, self.tmp, self.redis = args, backend, tmp, redis
        self.key, self.token = key, token
        self.running: list[Proc] = []  # stopped in main's ``finally`` on a failed run
        self.notes: list[str] = []
        self.canary_started = False
        self.exits = contextlib.ExitStack()  # the OTLP receiver, when a spans case runs
        self.otlp: Receiver | None = None

    def switchyard(self, case: str, tree: Path, suffix: str, round_: int) -> list[dict]:
        """Start the case's gateway process(es) and agent from ``tree``, measure, stop."""
        args, backend, tmp = self.args, self.backend, self.tmp
        label, server, kind, hop, workers = CASES[case]
        label += suffix
        if case == "canary" and not self.canary_started:
            backend.shell(START_CANARY)
            self.canary_started = True
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**backend.env, "LOG_LEVEL": "WARNING"}
        if hop:  # no data links, so the front process must go through Redis
            env["SWITCHYARD_AGENT_LINKS"] = "0"
        if case in SPAN_RATIOS:
            if self.otlp is None:
                self.otlp = self.exits.enter_context(otlp_receiver("grpc"))
            ratio = {"OTEL_TRACES_SAMPLER_ARG": SPAN_RATIOS[case]}
            env.update(self.otlp.env(OTEL_TRACES_SAMPLER="parentbased_traceidratio", **ratio))
        grpc_address = f"127.0.0.1:{free_port()}"
        if kind == "grpc":
            env["SWITCHYARD_GRPC_HOST"], env["SWITCHYARD_GRPC_PORT"] = grpc_address.split(":")
        # --profile: the gateway and the agent run under bench/cpu_sampler.py.
        sampled = args.profile and not hop and workers == 1
        name = label.replace(" ", "_").replace("/", "_").replace(",", "")
        outs = (tmp / f"{name}-gateway.raw", tmp / f"{name}-agent.raw")
        cmd = [PY, *SERVERS[server].format(port=port).split()]
        cmd = ["taskset", "-c", "0", *(stages.sampled_command(outs[0], cmd) if sampled else cmd)]
        if workers > 1:
            cmd += ["--workers", str(workers)]
            # One metrics directory, so /metrics sums the workers' dispatch counters.
            env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(dir=tmp)
        srv = Proc(server, cmd, env, tmp, cwd=tree)
        servers = [srv]
        if hop:
            front_port = free_port()
            cmd = ["taskset", "-c", "0", PY, *SERVERS[server].format(port=front_port).split()]
            servers.append(Proc(f"{server}-front", cmd, env, tmp, cwd=tree))
        agent_cmd = f"{PY} -m serving_agent --platform {url} --token {self.token} "
        agent_cmd += f"--cache-dir {tmp / 'cache'} --log-level WARNING"
        cmd = agent_cmd.split()
        cmd = ["taskset", "-c", "0", *(stages.sampled_command(outs[1], cmd) if sampled else cmd)]
        agent = Proc("agent", cmd, env, tmp, cwd=tree)
        self.running[:] = [*servers, agent]
        headers = {"Authorization": f"Bearer {self.key}"}
        wait_until(partial(_ok, f"{url}/v2/models/fraud-detector/ready", headers), 60, agent)
        if case == "canary":
            v2_ready = f"{url}/v2/models/fraud-detector/versions/2/ready"
            wait_until(partial(_ok, v2_ready, headers), 60, agent)
        if workers > 1:  # the agent's data links reach the other workers within seconds
            time.sleep(8)
        if hop:
            url = f"http://127.0.0.1:{front_port}"
            front_ready = f"{url}/v2/models/fraud-detector/ready"
            wait_until(partial(_ok, front_ready, headers), 60, servers[-1])
        # The agent also loads the demo's other versions (the text models, MiniLM); loading
        # them in a measured run put torch's imports in the agent's CPU per request.
        wait_until(partial(_agent_settled, backend, agent.popen.pid), 300, agent)
        pids = [*(p.popen.pid for p in servers), agent.popen.pid, self.redis.pid]
        if kind == "grpc":
            load = grpc_streams(grpc_address, self.key)
        else:
            load = wrk_load(url + PATHS[kind], self.key, BODIES[kind])
        spied = [(srv.popen.pid, outs[0]), (agent.popen.pid, outs[1])] if sampled else None
        rows = _in_round(measure(label, load, pids, args, spied), round_)
        if workers > 1:
            counts = dispatched(url)
            self.notes.append(
                f"{label}: {counts['local']:,.0f} requests handed to the agent in process, "
                f"{counts['forwarded']:,.0f} through Redis (warm-ups included)."
            )
        agent.stop()
        for proc in servers:
            proc.stop()
        return rows


def _stacks_of_a_silent_server(label: str, connections: int, pids: list[int]) -> None:
    """A run answered nothing (seen three times in ~46 runs on 2026-12-07, the servers idle):
    print where each server process's threads wait, read by py-spy when it is installed."""
    print(f"{label}, {connections} connections: no request was answered", file=sys.stderr)
    spy = shutil.which("py-spy") or str(Path(PY).parent / "py-spy")
    if not Path(spy).exists():
        print("  (install py-spy to see where the processes wait)", file=sys.stderr)
        return
    for pid in pids:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
        print(f"  pid {pid}:\n{dump.stdout or dump.stderr}", file=sys.stderr)


def _agent_settled(backend: Any, pid: int) -> bool:
    """Whether the live agent sessions have no version loading any more and the agent has
    rested for a second (under 5 % of a CPU): a load that has not reported yet shows there."""
    rows = backend.query(
        "SELECT version_states FROM gateway_agentsession WHERE disconnected_at IS NULL"
    )
    states = [s for (row,) in rows for s in (row or {}).values()]
    if not states or any(s.get("state") == "loading" for s in states):
        return False
    before = cpu_seconds(pid)
    time.sleep(1.0)
    return cpu_seconds(pid) - before < 0.05


def _in_round(rows: list[dict], round_: int) -> list[dict]:
    return [row | {"round": round_} for row in rows]


def _worktree(ref: str, tmp: Path) -> Path:
    """``ref``'s tree in a temporary git worktree (run with this checkout's .venv)."""
    path = tmp / "baseline"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), ref],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return path


def _medians(rows: list[dict], baselines: list[str]) -> str:
    """Per case and connection count, the medians over the rounds; then, per round, each
    baseline's and each peer's CPU per request against the working tree's first case, and
    the median of those ratios (pairs from the same round, minutes apart)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["connections"]), []).append(row)
    out = [
        f"Medians over {max(r['round'] for r in rows) + 1} rounds:",
        "",
        "| case | connections | req/s | p99 ms | server CPU ms/req |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (case, connections), group in groups.items():
        out.append(
            f"| {case} | {connections} | {statistics.median(r['rps'] for r in group):,.0f} | "
            f"{statistics.median(r['p99_ms'] for r in group):.2f} | "
            f"{statistics.median(r['cpu_ms_per_req'] for r in group):.3f} |"
        )
    cases = list(dict.fromkeys(case for case, _ in groups))
    first = cases[0]
    out += [
        "",
        f"Paired ratios, server CPU per request against {first!r} (each round's pair; median):",
        "",
        "| case | connections | ratios by round | median |",
        "| --- | --- | --- | --- |",
    ]
    for case in cases[1:]:
        for (other, connections), group in groups.items():
            if other != case:
                continue
            ratios = []
            for row in group:
                mine = [
                    r for r in groups.get((first, connections), []) if r["round"] == row["round"]
                ]
                if mine:
                    ratios.append(row["cpu_ms_per_req"] / mine[0]["cpu_ms_per_req"])
            if ratios:
                shown = ", ".join(f"{r:.2f}" for r in ratios)
                out.append(
                    f"| {case} | {connections} | {shown} | {statistics.median(ratios):.2f}x |"
                )
    return "\n".join(out) + "\n"


def _ok(url: str, headers: dict) -> bool:
    try:
        return httpx.get(url, headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _row(r: dict) -> str:
    case = r["case"] if not r.get("round") else f"{r['case']} (round {r['round'] + 1})"
    return (
        f"| {case} | {r['connections']} | {r['rps']:,.0f} | {r['p50_ms']:.2f} | "
        f"{r['p99_ms']:.2f} | {r['cpu_ms_per_req']:.3f} | {r['errors']} |"
    )


def _table(rows: list[dict], single: float, batched: float) -> str:
    head = (
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({os.cpu_count()} CPUs): demo fraud MLP (32→256→256→2), one item per request, "
        "PostgreSQL + Redis, server-side processes on CPU 0, wrk (gRPC: bench/grpc_load.py) on "
        "CPU 1.\n\n"
        "| case | connections | req/s | p50 ms | p99 ms | server CPU ms/req | errors |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n"
    )
    tail = (
        f"\nIn-process ONNX Runtime, same model, one thread: {single:,.0f} req/s at batch 1, "
        f"{batched:,.0f} items/s at batch 64.\n"
    )
    return head + "\n".join(_row(r) for r in rows) + "\n" + tail


if __name__ == "__main__":
    main()
