"""Benchmark token streaming: time to first token (median, p90) and aggregate tokens/s at 1, 8
and 32 concurrent streams through the platform, next to the same engine generating in process.

Platform: uvicorn and a serving agent pinned to CPU 0, PostgreSQL + a Redis of its own, the demo
text model's architecture (``platform_site/demo/storyteller.py``; briefly trained weights decode
at the same speed as fully trained ones). Clients are websocket streams from this process, pinned to
CPU 1. In process: the agent's own engine (``load_engine``) on the same artifact, in a process of
its own pinned to CPU 0 with one torch thread like the agent, fed the same requests; its rounds
alternate with the platform's, so both see the same machine. Every stream asks for ``--tokens``
greedy tokens with no stop sequence, so all streams do the same work. The CPU time the server
processes spent per token is read from ``/proc``. Run:
``.venv/bin/python bench/stream_bench.py`` (``make bench-stream``); another generative artifact
with ``--artifact PATH --format FORMAT`` (registered as the model ``bench-generator``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import websockets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.oip_bench import start_redis  # noqa: E402
from tests.e2e.harness import PY, Proc, free_port, services_backend, wait_until  # noqa: E402

PROMPT = "Call me Ishmael. Some years ago, never mind how long precisely, "


BENCH_MODEL = "bench-generator"


def prompt(i: int) -> str:
    return f"{PROMPT}{i}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def platform_round(
    url: str, key: str, model: str, streams: int, tokens: int, deflate: bool = True
) -> tuple[list, float, int, int]:
    """N concurrent streams, one socket each: (TTFT seconds per stream, aggregate tokens/s,
    tokens, token messages)."""
    ws_url = url.replace("http://", "ws://") + f"/ws/v1/models/{model}/generate"
    headers = {"Authorization": f"Bearer {key}"}
    # permessage-deflate is what websockets and browsers ask for by default.
    options: dict = {} if deflate else {"compression": None}
    socks = [
        await websockets.connect(ws_url, additional_headers=headers, **options)
        for _ in range(streams)
    ]

    async def one(i: int, sock) -> tuple[float, int, float, int]:
        request = {"type": "generate", "id": f"s{i}", "prompt": prompt(i)}
        request |= {"max_tokens": tokens, "temperature": 0}
        sent = time.perf_counter()
        await sock.send(json.dumps(request))
        first, messages = None, 0
        while True:
            frame = json.loads(await sock.recv())
            if frame["type"] == "token":
                messages += 1
                if first is None:
                    first = time.perf_counter() - sent
            if frame["type"] == "done":
                return first, frame["usage"]["output_tokens"], time.perf_counter(), messages
            if frame["type"] == "error":
                raise RuntimeError(frame)

    started = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i, s) for i, s in enumerate(socks)))
    finally:
        await asyncio.gather(*(s.close() for s in socks))
    ended = max(r[2] for r in results)
    total = sum(r[1] for r in results)
    return [r[0] for r in results], total / (ended - started), total, sum(r[3] for r in results)


async def in_process_round(engine, streams: int, tokens: int) -> tuple[list, float, int, int]:
    """The same requests straight into the agent's engine."""
    from serving_agent.protocol import GenerateDone, GenerateRequest, TokenChunk, decode_frame

    loop = asyncio.get_running_loop()
    firsts: dict[int, float] = {}
    done: dict[int, asyncio.Future] = {i: loop.create_future() for i in range(streams)}
    sent: dict[int, float] = {}
    chunks = 0

    async def reply(frames: list[bytes]) -> None:
        nonlocal chunks
        now = time.perf_counter()
        for frame in frames:
            header, _ = decode_frame(frame)
            # A step's text comes as one batch of chunks (single chunks before it did).
            for item in getattr(header, "chunks", [header]):
                if isinstance(item, TokenChunk):
                    chunks += 1
                    firsts.setdefault(item.id, now - sent[item.id])
                elif isinstance(item, GenerateDone):
                    done[item.id].set_result((item.output_tokens, now))

    started = time.perf_counter()
    for i in range(streams):
        sent[i] = time.perf_counter()
        request = GenerateRequest(i, 1, prompt(i), max_new_tokens=tokens, temperature=0.0)
        engine.submit(request, reply)
    results = await asyncio.gather(*done.values())
    ended = max(r[1] for r in results)
    total = sum(r[0] for r in results)
    return [firsts[i] for i in range(streams)], total / (ended - started), total, chunks


def summarise(rounds: list[tuple[list, float, int, int]]) -> dict:
    ttfts = sorted(t for r in rounds for t in r[0])
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p90_ms": statistics.quantiles(ttfts, n=10)[-1] * 1000 if len(ttfts) > 1 else 0.0,
        "tokens_per_s": statistics.median(r[1] for r in rounds),
        "tokens": sum(r[2] for r in rounds),
        "tokens_per_message": sum(r[2] for r in rounds) / max(1, sum(r[3] for r in rounds)),
    }


async def measure(
    run_round, levels: list[int], rounds: int, tokens: int, pids: dict[str, int], engine: Engine
) -> tuple[dict[int, dict], dict[int, dict]]:
    """Each level's rounds through the platform (``run_round``) and in process (``engine``),
    alternated round by round, so that both see the same machine: on a shared VM the speed
    swings by 2x within minutes, and rounds taken minutes apart compared that swing instead of
    the platform. Returns (platform, in process) per level, with the CPU per token of each of
    ``pids`` (name: process) and of the engine's process, and the median of the paired rounds'
    rate ratios."""
    await run_round(1, tokens)  # warm-up
    engine.round(1, tokens)
    through, local = {}, {}
    for n in levels:
        cpu = dict.fromkeys(pids, 0.0)
        ours, theirs, engine_cpu = [], [], 0.0
        for _ in range(rounds):
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            ours.append(await run_round(n, tokens))
            for name, pid in pids.items():
                cpu[name] += cpu_seconds(pid) - before[name]
            result, used = engine.round(n, tokens)
            theirs.append(result)
            engine_cpu += used
        through[n], local[n] = summarise(ours), summarise(theirs)
        for name in pids:
            through[n][f"{name}_cpu_us_per_token"] = cpu[name] / through[n]["tokens"] * 1e6
        local[n]["engine_cpu_us_per_token"] = engine_cpu / local[n]["tokens"] * 1e6
        through[n]["paired_ratio"] = statistics.median(
            a[1] / b[1] for a, b in zip(ours, theirs, strict=True)
        )
        print(f"  {n} streams: platform {through[n]}\n  in process {local[n]}", flush=True)
    return through, local


class Engine:
    """The agent's engine in a process of its own on CPU 0 (where the agent runs), one torch
    thread like the agent, fed rounds on request (``engine_worker``)."""

    def __init__(self, artifact: Path, fmt: str, max_streams: int) -> None:
        cmd = [PY, str(Path(__file__).resolve()), "--engine-worker", str(artifact), fmt]
        cmd.append(str(max_streams))
        self.proc = subprocess.Popen(
            ["taskset", "-c", "0", *cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def round(self, streams: int, tokens: int) -> tuple[tuple[list, float, int, int], float]:
        """One round of ``streams`` streams: (its result as ``platform_round``'s, CPU seconds)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{streams} {tokens}\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return tuple(answer["result"]), answer["cpu_s"]  # type: ignore[return-value]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def engine_worker(artifact: Path, fmt: str, max_streams: int) -> None:
    """Load the engine as the agent does and run the rounds asked on stdin, one a line
    ("streams tokens"), answering each with a JSON line on stdout."""
    import torch

    from serving_agent._generate import load_engine
    from serving_agent.protocol import GenerationLimits, VersionSpec

    torch.set_num_threads(1)
    limits = GenerationLimits(max_input_tokens=128, max_output_tokens=128, max_streams=max_streams)
    spec = VersionSpec(
        version_id=1,
        model="bench",
        version=1,
        sha256="0" * 64,
        artifact_url="",
        format=fmt,
        inputs=[],
        outputs=[],
        device="cpu",
        generation=limits,
    )
    if fmt == "hf":
        from serving_agent._hf import load_hf_engine

        # The agent's own loader; it extracts next to the artifact, so copy it somewhere ours.
        copy = Path(tempfile.mkdtemp()) / artifact.name
        copy.write_bytes(artifact.read_bytes())
        engine, _ = load_hf_engine(copy, spec, threads=1)
    else:
        engine, _ = load_engine(artifact, spec, threads=1)  # as the agent loads it

    async def serve() -> None:
        for line in sys.stdin:
            streams, tokens = map(int, line.split())
            before = cpu_seconds(os.getpid())  # the engine's thread and its event loop
            result = await in_process_round(engine, streams, tokens)
            used = cpu_seconds(os.getpid()) - before
            print(json.dumps({"result": result, "cpu_s": used}), flush=True)

    asyncio.run(serve())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--artifact",
        type=Path,
        help="a generative artifact to serve instead of the demo storyteller (an upload file)",
    )
    parser.add_argument("--format", default="textgen", help="the --artifact's format")
    parser.add_argument(
        "--gateway-cpus",
        default="0",
        help="the CPUs of the server (taskset -c); the agent stays on CPU 0, the clients on 1",
    )
    parser.add_argument(
        "--no-deflate",
        action="store_true",
        help="clients do not ask for permessage-deflate (browsers and websockets do)",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "stream.md")
    parser.add_argument("--engine-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_worker:
        artifact, fmt, max_streams = args.engine_worker
        engine_worker(Path(artifact), fmt, int(max_streams))
        return
    levels = [int(n) for n in args.streams.split(",")]
    model = BENCH_MODEL if args.artifact else "storyteller"

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-stream-bench-"))
    redis, redis_port = start_redis()
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    backend = services_backend(tmp)
    backend.env["SWITCHYARD_DEMO_TEXT_SECONDS"] = "1"  # speed does not depend on training
    running: list[Proc] = []
    engine: Engine | None = None
    try:
        backend.manage("bootstrap_demo")  # writes its credentials to demo.json, 0600
        creds = json.loads((backend.var_dir / "demo.json").read_text())
        key, token = creds["api_key"], creds["node_token"]
        if args.artifact:
            register(backend, args.artifact.resolve(), args.format)
        artifact = Path(
            backend.shell(
                "from registry.models import ModelVersion; print(ModelVersion.objects.get("
                f"model__name={model!r}).artifact.path)"
            ).strip()
        )
        backend.shell(
            "from registry.models import ModelVersion; ModelVersion.objects.filter("
            f"model__name={model!r}).update(max_streams={max(levels)}); "
            "from tenants.models import Quota; Quota.objects.update("
            f"max_concurrent_streams={max(levels)}, tokens_per_minute=10**9)"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**backend.env, "LOG_LEVEL": "WARNING"}
        server = f"-m uvicorn platform_site.asgi:application --host 127.0.0.1 --port {port} "
        server += "--no-access-log --log-level warning"
        pinned = ["taskset", "-c", args.gateway_cpus, PY]
        running.append(Proc("uvicorn", [*pinned, *server.split()], env, tmp))
        agent = f"-m serving_agent --platform {url} --token {token} --cache-dir {tmp / 'cache'}"
        running.append(Proc("agent", ["taskset", "-c", "0", PY, *agent.split()], env, tmp))
        headers = {"Authorization": f"Bearer {key}"}

        def ready() -> bool:
            try:
                answer = httpx.get(f"{url}/v2/models/{model}/ready", headers=headers)
                return answer.status_code == 200
            except httpx.HTTPError:
                return False

        engine = Engine(artifact, args.format, max(levels))
        wait_until(ready, 120, running[-1])
        os.sched_setaffinity(0, {1})  # the clients
        print("through the platform and in process, round by round:", flush=True)
        pids = {"gateway": running[0].popen.pid, "agent": running[1].popen.pid}
        through, local = asyncio.run(
            measure(
                lambda n, t: platform_round(url, key, model, n, t, not args.no_deflate),
                levels,
                args.rounds,
                args.tokens,
                pids,
                engine,
            )
        )
    finally:
        if engine is not None:
            engine.stop()
        for proc in running:
            proc.stop()
        backend.close()
        redis.terminate()
    if args.format == "textgen":
        from serving_agent.textgen import read_config

        config = read_config(artifact.read_bytes())
        shape = f"the {model} model ({config.n_layer} layers, {config.n_head} heads, "
        shape += f"{config.n_embd} wide, byte-level)"
    else:
        shape = f"{args.artifact.name} ({args.format})"
    table = render(through, local, args, shape)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)


def register(backend, artifact: Path, fmt: str) -> None:
    """Upload ``artifact`` as version 1 of the demo tenant's ``bench-generator``, in production."""
    backend.shell(
        "from django.core.files import File; from registry.models import Model, TaskKind; "
        "from registry.services import create_version, set_alias; "
        "from tenants.models import Tenant; "
        f"model = Model.objects.create(tenant=Tenant.objects.get(slug='demo'), "
        f"name={BENCH_MODEL!r}, task=TaskKind.GENERATOR); "
        f"upload = File(open({str(artifact)!r}, 'rb'), name={artifact.name!r}); "
        f"version = create_version(model, upload, format={fmt!r}, "
        "max_input_tokens=128, max_output_tokens=128); "
        "set_alias(model, 'production', version)"
    )


def render(through: dict, local: dict, args, shape: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Run {now} on {platform.node()} ({os.cpu_count()} CPUs): {shape}, {args.tokens} "
        f"greedy tokens per stream, {args.rounds} rounds each way, alternated (tokens/s: their "
        "median; TTFT: over every stream of every round); uvicorn on CPU "
        f"{args.gateway_cpus}, agent on CPU 0, clients on CPU 1"
        + (", no permessage-deflate." if args.no_deflate else "."),
        "",
        "| streams | TTFT p50 / p90 ms (platform) | TTFT p50 / p90 ms (in process) | "
        "tokens/s (platform) | tokens/s (in process) | platform / in process (paired) | "
        "platform / 1 stream | CPU µs/token: gateway / agent / in process | "
        "CPU-bound platform / in process | tokens per message (platform) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    single = through[min(through)]["tokens_per_s"]
    for n in sorted(through):
        p, i = through[n], local[n]
        lines.append(
            f"| {n} | {p['ttft_p50_ms']:.2f} / {p['ttft_p90_ms']:.2f} | "
            f"{i['ttft_p50_ms']:.2f} / {i['ttft_p90_ms']:.2f} | {p['tokens_per_s']:,.0f} | "
            f"{i['tokens_per_s']:,.0f} | {p['paired_ratio']:.0%} | "
            f"{p['tokens_per_s'] / single:.1f}x | {p['gateway_cpu_us_per_token']:.0f} / "
            f"{p['agent_cpu_us_per_token']:.0f} / {i['engine_cpu_us_per_token']:.0f} | "
            f"{cpu_bound(p, i):.0%} | {p['tokens_per_message']:.2f} |"
        )
    lines += [
        "",
        "Platform / in process (paired): each platform round is followed by the same round in "
        "process; the median over the rounds of the two rates' ratio.",
        "",
        "CPU-bound platform / in process: the in-process engine's CPU per token over the gateway's "
        "and the agent's together, the rate the platform keeps when CPU 0 does nothing else; "
        "it holds when other work shares the machine, where the tokens/s do not.",
    ]
    return "\n".join(lines) + "\n"


def cpu_bound(through: dict, local: dict) -> float:
    spent = through["gateway_cpu_us_per_token"] + through["agent_cpu_us_per_token"]
    return local["engine_cpu_us_per_token"] / spent if spent else 0.0


if __name__ == "__main__":
    main()
