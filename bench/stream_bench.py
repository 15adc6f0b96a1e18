"""Benchmark token streaming: time to first token and aggregate tokens/s at 1, 8 and 32
concurrent streams through the platform, next to the same engine generating in process.

Platform: uvicorn and a serving agent pinned to CPU 0, PostgreSQL + a Redis of its own, the demo
text model's architecture (``platform_site/demo/storyteller.py``; briefly trained weights decode
at the same speed as fully trained ones). Clients are websocket streams from this process, pinned to
CPU 1. In process: the agent's own ``Engine`` on the same model, pinned to CPU 0 with one torch
thread like the agent, fed the same requests. Every stream asks for ``--tokens`` greedy tokens
with no stop sequence, so all streams do the same work. Run:
``.venv/bin/python bench/stream_bench.py`` (``make bench-stream``).
"""

from __future__ import annotations

import argparse
import asyncio
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
import websockets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.oip_bench import start_redis  # noqa: E402
from tests.e2e.harness import PY, Proc, free_port, services_backend, wait_until  # noqa: E402

PROMPT = "Call me Ishmael. Some years ago, never mind how long precisely, "


def prompt(i: int) -> str:
    return f"{PROMPT}{i}"


async def platform_round(url: str, key: str, streams: int, tokens: int) -> tuple[list, float]:
    """N concurrent streams, one socket each: (TTFT seconds per stream, aggregate tokens/s)."""
    ws_url = url.replace("http://", "ws://") + "/ws/v1/models/storyteller/generate"
    headers = {"Authorization": f"Bearer {key}"}
    socks = [await websockets.connect(ws_url, additional_headers=headers) for _ in range(streams)]

    async def one(i: int, sock) -> tuple[float, int, float]:
        request = {"type": "generate", "id": f"s{i}", "prompt": prompt(i)}
        request |= {"max_tokens": tokens, "temperature": 0}
        sent = time.perf_counter()
        await sock.send(json.dumps(request))
        first = None
        while True:
            frame = json.loads(await sock.recv())
            if frame["type"] == "token" and first is None:
                first = time.perf_counter() - sent
            if frame["type"] == "done":
                return first, frame["usage"]["output_tokens"], time.perf_counter()
            if frame["type"] == "error":
                raise RuntimeError(frame)

    started = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(i, s) for i, s in enumerate(socks)))
    finally:
        await asyncio.gather(*(s.close() for s in socks))
    ended = max(r[2] for r in results)
    return [r[0] for r in results], sum(r[1] for r in results) / (ended - started)


async def in_process_round(engine, streams: int, tokens: int) -> tuple[list, float]:
    """The same requests straight into the agent's engine."""
    from serving_agent.protocol import GenerateDone, GenerateRequest, TokenChunk, decode_frame

    loop = asyncio.get_running_loop()
    firsts: dict[int, float] = {}
    done: dict[int, asyncio.Future] = {i: loop.create_future() for i in range(streams)}
    sent: dict[int, float] = {}

    async def reply(frames: list[bytes]) -> None:
        now = time.perf_counter()
        for frame in frames:
            header, _ = decode_frame(frame)
            if isinstance(header, TokenChunk) and header.id not in firsts:
                firsts[header.id] = now - sent[header.id]
            elif isinstance(header, GenerateDone):
                done[header.id].set_result((header.output_tokens, now))

    started = time.perf_counter()
    for i in range(streams):
        sent[i] = time.perf_counter()
        request = GenerateRequest(i, 1, prompt(i), max_new_tokens=tokens, temperature=0.0)
        engine.submit(request, reply)
    results = await asyncio.gather(*done.values())
    ended = max(r[1] for r in results)
    return [firsts[i] for i in range(streams)], sum(r[0] for r in results) / (ended - started)


def summarise(rounds: list[tuple[list, float]]) -> dict:
    ttfts = [t for r in rounds for t in r[0]]
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "tokens_per_s": statistics.median(r[1] for r in rounds),
    }


async def measure(run_round, levels: list[int], rounds: int, tokens: int) -> dict[int, dict]:
    await run_round(1, tokens)  # warm-up
    out = {}
    for n in levels:
        out[n] = summarise([await run_round(n, tokens) for _ in range(rounds)])
        print(f"  {n} streams: {out[n]}", flush=True)
    return out


def in_process(artifact: Path, levels: list[int], rounds: int, tokens: int) -> dict[int, dict]:
    import torch

    from serving_agent._generate import Engine
    from serving_agent.protocol import GenerationLimits
    from serving_agent.textgen import from_safetensors

    os.sched_setaffinity(0, {0})  # where the agent ran
    torch.set_num_threads(1)
    model = from_safetensors(artifact, "cpu")
    limits = GenerationLimits(max_input_tokens=128, max_output_tokens=128, max_streams=max(levels))
    engine = Engine(model, limits, threads=1)
    return asyncio.run(measure(lambda n, t: in_process_round(engine, n, t), levels, rounds, tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "stream.md")
    args = parser.parse_args()
    levels = [int(n) for n in args.streams.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-stream-bench-"))
    redis, redis_port = start_redis()
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    backend = services_backend(tmp)
    backend.env["SWITCHYARD_DEMO_TEXT_SECONDS"] = "1"  # speed does not depend on training
    running: list[Proc] = []
    try:
        backend.manage("bootstrap_demo")  # writes its credentials to demo.json, 0600
        creds = json.loads((backend.var_dir / "demo.json").read_text())
        key, token = creds["api_key"], creds["node_token"]
        artifact = Path(
            backend.shell(
                "from registry.models import ModelVersion; print(ModelVersion.objects.get("
                "model__name='storyteller').artifact.path)"
            ).strip()
        )
        backend.shell(
            "from registry.models import ModelVersion; ModelVersion.objects.filter("
            f"model__name='storyteller').update(max_streams={max(levels)}); "
            "from tenants.models import Quota; Quota.objects.update("
            f"max_concurrent_streams={max(levels)}, tokens_per_minute=10**9)"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**backend.env, "LOG_LEVEL": "WARNING"}
        server = f"-m uvicorn platform_site.asgi:application --host 127.0.0.1 --port {port} "
        server += "--no-access-log --log-level warning"
        running.append(Proc("uvicorn", ["taskset", "-c", "0", PY, *server.split()], env, tmp))
        agent = f"-m serving_agent --platform {url} --token {token} --cache-dir {tmp / 'cache'}"
        running.append(Proc("agent", ["taskset", "-c", "0", PY, *agent.split()], env, tmp))
        headers = {"Authorization": f"Bearer {key}"}

        def ready() -> bool:
            try:
                answer = httpx.get(f"{url}/v2/models/storyteller/ready", headers=headers)
                return answer.status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 120, running[-1])
        os.sched_setaffinity(0, {1})  # the clients
        print("through the platform:", flush=True)
        through = asyncio.run(
            measure(lambda n, t: platform_round(url, key, n, t), levels, args.rounds, args.tokens)
        )
        for proc in running:
            proc.stop()
        print("in process:", flush=True)
        local = in_process(artifact, levels, args.rounds, args.tokens)
    finally:
        for proc in running:
            proc.stop()
        backend.close()
        redis.terminate()
    from serving_agent.textgen import read_config

    config = read_config(artifact.read_bytes())
    shape = f"{config.n_layer} layers, {config.n_head} heads, {config.n_embd} wide"
    table = render(through, local, args, shape)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)


def render(through: dict, local: dict, args, shape: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Run {now} on {platform.node()} ({os.cpu_count()} CPUs): the demo text model "
        f"({shape}, byte-level), {args.tokens} greedy tokens per stream, median of "
        f"{args.rounds} rounds; uvicorn + agent on CPU 0, clients on CPU 1.",
        "",
        "| streams | TTFT p50 ms (platform) | TTFT p50 ms (in process) | overhead ms | "
        "tokens/s (platform) | tokens/s (in process) | platform / 1 stream |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    single = through[min(through)]["tokens_per_s"]
    for n in sorted(through):
        p, i = through[n], local[n]
        lines.append(
            f"| {n} | {p['ttft_p50_ms']:.2f} | {i['ttft_p50_ms']:.2f} | "
            f"{p['ttft_p50_ms'] - i['ttft_p50_ms']:.2f} | {p['tokens_per_s']:,.0f} | "
            f"{i['tokens_per_s']:,.0f} | {p['tokens_per_s'] / single:.1f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
