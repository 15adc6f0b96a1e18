"""Embeddings per second for MiniLM-L6 through the platform (OpenAI's /v1/embeddings, one
string per request, 1/16/64 concurrent connections) next to ONNX Runtime with the same
tokenizer called in-process at batch 1/16/64, in the same run.

The server and the agent (one ONNX Runtime thread, its default) are pinned to CPU 0, as is the
in-process run; the load generator (asyncio + httpx in this process) to CPU 1. The agent batches
concurrent requests (max_batch_size 64, no added delay), so the platform's 16- and 64-connection
rows are the in-process batch-16/64 rows' counterpart. ``--peers kserve,torchserve`` adds peer
model servers (bench/peers_bench.py: KServe's model server, TorchServe batching 32 / 5 ms)
serving the same export behind the same tokenizer over OIP v2 REST, loaded the same way.
Bounded: under 2 minutes, plus about a minute per peer.
Run: ``.venv/bin/python bench/embed_bench.py [--seconds 5] [--door oip] [--peers kserve]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peers_bench import start_peer  # noqa: E402

from platform_site.demo import minilm  # noqa: E402
from tests.e2e.harness import (  # noqa: E402
    PY,
    Proc,
    answers,
    create_node,
    create_tenant,
    embedded_backend,
    free_port,
    wait_until,
)

LEVELS = (1, 16, 64)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Switchyard batches concurrent requests on the serving agent.",
    "Sentence embeddings map text to vectors whose distances mean something.",
    "A short one.",
]


def in_process(seconds: float) -> dict[int, float]:
    """ONNX Runtime on one thread, tokenizing as the agent does: embeddings/s per batch size."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(minilm.exported()), opts, providers=["CPUExecutionProvider"])
    tokenizer = Tokenizer.from_file(str(minilm.tokenizer_path()))
    tokenizer.enable_padding()  # to the batch's longest, as the agent pads (truncation: the file's)
    rates = {}
    for batch in LEVELS:
        texts = [SENTENCES[i % len(SENTENCES)] for i in range(batch)]
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            enc = tokenizer.encode_batch(texts)
            feed = {
                "input_ids": np.array([e.ids for e in enc], np.int64),
                "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
                "token_type_ids": np.array([e.type_ids for e in enc], np.int64),
            }
            session.run(None, feed)
            count += batch
        rates[batch] = count / (time.perf_counter() - start)
    return rates


def openai_request(text: str) -> tuple[str, dict]:
    return "/v1/embeddings", {"model": "minilm", "input": text}


def oip_request(text: str) -> tuple[str, dict]:
    tensor = {"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}
    return "/v2/models/minilm/infer", {"inputs": [tensor], "outputs": [{"name": OUTPUT}]}


OUTPUT = minilm.OUTPUT
DOORS = {"openai": openai_request, "oip": oip_request}


async def load(
    url: str,
    key: str,
    connections: int,
    seconds: float,
    request: Callable[[str], tuple[str, dict]],
) -> tuple[float, float]:
    """Closed loop: each connection sends its next request (``request(text)``: its path and
    JSON body) when the last is answered. Returns (embeddings/s, p99 latency ms) over the
    measured window after a 1 s warm-up."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    latencies: list[float] = []
    errors = 0

    async def worker(i: int, until: float, record: bool) -> None:
        nonlocal errors
        # A client per connection: one httpx pool shared by 64 connections measured here as
        # the bottleneck (126 trivial requests/s, against 1,200 with a client each).
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
            n = i
            while time.perf_counter() < until:
                path, body = request(SENTENCES[n % len(SENTENCES)])
                n += 1
                start = time.perf_counter()
                reply = await client.post(path, json=body)
                if reply.status_code != 200:
                    errors += 1
                elif record:
                    latencies.append(time.perf_counter() - start)

    warm = time.perf_counter() + 1.0
    await asyncio.gather(*(worker(i, warm, False) for i in range(connections)))
    start = time.perf_counter()
    until = start + seconds
    await asyncio.gather(*(worker(i, until, True) for i in range(connections)))
    elapsed = time.perf_counter() - start
    if errors:
        print(f"  {errors} requests failed at {connections} connections", file=sys.stderr)
    return len(latencies) / elapsed, float(np.percentile(latencies, 99) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level")
    parser.add_argument(
        "--peers",
        default="",
        help="peer model servers to measure beside it (kserve,torchserve), same model",
    )
    parser.add_argument(
        "--door",
        choices=sorted(DOORS),
        default="openai",
        help="POST /v1/embeddings (Django view) or OIP v2 REST infer (the lean ASGI app)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    two_cpus = len(os.sched_getaffinity(0)) >= 2
    # Every thread the server and the agent start runs on CPU 0.
    cpu0 = ["taskset", "-c", "0"] if two_cpus else []
    artifact = minilm.exported()  # cached after the first run
    backend = embedded_backend(Path(tempfile.mkdtemp(prefix="sy-embed-bench-")))
    port = free_port()
    server = Proc(
        "uvicorn",
        [
            *cpu0,
            PY,
            *f"-m platform_site.serve platform_site.asgi:application --host 127.0.0.1 "
            f"--port {port} --no-access-log --log-level warning "
            "--http gateway.http_bounds:BoundedHttpProtocol".split(),
        ],
        backend.env,
        backend.var_dir,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(url), 30, server)
    token = create_node(backend, "bench")
    agent = Proc(
        "agent",
        [
            *cpu0,
            *[PY, "-m", "serving_agent", "--platform", url, "--token", token],
            *["--cache-dir", str(backend.var_dir / "cache")],
        ],
        backend.env,
        backend.var_dir,
    )
    try:
        if two_cpus:
            os.sched_setaffinity(0, {1})
        key = create_tenant(backend, "bench", rps=100000, burst=100000)
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as c:
            c.post("/api/v1/models", json={"name": "minilm", "task": "embedding"})
            files = {
                "artifact": ("model.onnx", artifact.read_bytes(), "application/octet-stream"),
                "tokenizer": ("tokenizer.json", minilm.tokenizer_path().read_bytes(), "text/json"),
            }
            made = c.post(
                "/api/v1/models/minilm/versions", files=files, data={"max_batch_size": "64"}
            )
            assert made.status_code == 201, made.text
            c.put("/api/v1/models/minilm/aliases/production", json={"version": 1})
            wait_until(lambda: c.get("/v2/models/minilm/ready").status_code == 200, 90, agent)
        door = DOORS[args.door]
        through = {n: asyncio.run(load(url, key, n, args.seconds, door)) for n in LEVELS}
    finally:
        agent.stop()
        server.stop()
        backend.close()
    peers = {}
    for name in [p for p in args.peers.split(",") if p]:
        peers[name] = measure_peer(name, artifact, args.seconds)
    if two_cpus:
        os.sched_setaffinity(0, {0})  # the in-process run gets the CPU the platform had
    local = in_process(min(args.seconds, 3.0))
    print()
    door_name = "/v1/embeddings" if args.door == "openai" else "OIP v2 REST infer"
    print(f"MiniLM-L6 embeddings/s via {door_name} (one string per request; in-process: a batch")
    print("of N; peers: OIP v2 REST, one string per request, the same ONNX export and tokenizer)")
    print(f"CPUs: {'servers and in-process on CPU 0, load on CPU 1' if two_cpus else 'shared'}")
    head = "| connections = batch | platform emb/s | p99 ms | in-process emb/s | platform share |"
    rule = "| --- | --- | --- | --- | --- |"
    for label, _ in peers.values():
        head += f" {label} emb/s | p99 ms | platform / it |"
        rule += " --- | --- | --- |"
    print(head)
    print(rule)
    for n in LEVELS:
        rate, p99 = through[n]
        row = f"| {n} | {rate:,.0f} | {p99:.1f} | {local[n]:,.0f} | {rate / local[n]:.0%} |"
        for _, rows in peers.values():
            peer_rate, peer_p99 = rows[n]
            row += f" {peer_rate:,.0f} | {peer_p99:.1f} | {rate / peer_rate:.2f}x |"
        print(row)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


def measure_peer(
    name: str, artifact: Path, seconds: float
) -> tuple[str, dict[int, tuple[float, float]]]:
    """A peer model server (bench/peers_bench.py) serving the same MiniLM export behind the
    same tokenizer, on CPU 0, loaded as the platform was: its label and rows by level."""
    tmp = Path(tempfile.mkdtemp(prefix=f"sy-embed-{name}-"))
    body = json.dumps(oip_request(SENTENCES[0])[1])
    peer = start_peer(name, artifact, tmp, body, model="minilm", tokenizer=minilm.tokenizer_path())
    try:
        parts = urlsplit(peer.url)
        origin, path = f"{parts.scheme}://{parts.netloc}", parts.path

        def request(text: str) -> tuple[str, dict]:
            return path, oip_request(text)[1]

        rows = {n: asyncio.run(load(origin, "", n, seconds, request)) for n in LEVELS}
    finally:
        peer.stop()
    return peer.label, rows


if __name__ == "__main__":
    main()
