"""``python -m serving_agent``: run the agent until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from . import telemetry
from ._agent import Agent
from ._cache import ArtifactCache
from ._memory import HOST_BUDGET_FRACTION, MiB

DEFAULT_CACHE = "~/.cache/switchyard-agent"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m serving_agent", description="Serve the models the platform assigns."
    )
    parser.add_argument(
        "--platform",
        default=env.get("SWITCHYARD_PLATFORM"),
        help="platform base URL, e.g. http://127.0.0.1:8000 (env SWITCHYARD_PLATFORM)",
    )
    parser.add_argument(
        "--token",
        default=env.get("SWITCHYARD_NODE_TOKEN"),
        help="node token (env SWITCHYARD_NODE_TOKEN)",
    )
    parser.add_argument(
        "--token-file",
        default=env.get("SWITCHYARD_NODE_TOKEN_FILE"),
        help="file holding the node token, instead of --token (env SWITCHYARD_NODE_TOKEN_FILE)",
    )
    parser.add_argument(
        "--cache-dir",
        default=env.get("SWITCHYARD_AGENT_CACHE", DEFAULT_CACHE),
        help=f"artifact cache (env SWITCHYARD_AGENT_CACHE, default {DEFAULT_CACHE})",
    )
    parser.add_argument("--name", help="node name reported to the platform (default: hostname)")
    parser.add_argument(
        "--deployment",
        default=env.get("SWITCHYARD_DEPLOYMENT"),
        help="the cluster Deployment this replica belongs to (env SWITCHYARD_DEPLOYMENT)",
    )
    parser.add_argument(
        "--memory-budget-mb",
        type=float,
        default=env.get("SWITCHYARD_AGENT_MEMORY_MB"),
        help="memory loaded versions may fill, in MiB (env SWITCHYARD_AGENT_MEMORY_MB; default: "
        f"the GPU's memory, else {HOST_BUDGET_FRACTION * 100:.0f}%% of the memory available at "
        "start)",
    )
    parser.add_argument(
        "--cold-after-s",
        type=float,
        default=env.get("SWITCHYARD_AGENT_COLD_AFTER_S", "30"),
        help="a version idle this long with nothing queued may be evicted to make room for "
        "another (env SWITCHYARD_AGENT_COLD_AFTER_S, default 30)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads for ONNX Runtime and torch"
    )
    parser.add_argument(
        "--alive-file",
        default=env.get("SWITCHYARD_ALIVE_FILE") or None,
        help="refresh this file every few seconds with 'ready' while connected to the platform "
        "(else 'not ready: ...'), for a liveness/readiness probe (env SWITCHYARD_ALIVE_FILE)",
    )
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    args = parser.parse_args(argv)
    if not args.platform:
        parser.error("--platform (or SWITCHYARD_PLATFORM) is required")
    if args.token_file:
        try:
            args.token = Path(args.token_file).expanduser().read_text().strip()
        except OSError as exc:
            parser.error(f"cannot read the token file: {exc}")
    if not args.token:
        parser.error("--token, --token-file or SWITCHYARD_NODE_TOKEN is required")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.memory_budget_mb is not None and args.memory_budget_mb <= 0:
        parser.error("--memory-budget-mb must be positive")
    if args.cold_after_s < 0:
        parser.error("--cold-after-s must not be negative")
    return args


def memory_budget_bytes(args: argparse.Namespace) -> int:
    """The budget in bytes; 0 leaves it to the agent's default for the node."""
    return 0 if args.memory_budget_mb is None else int(args.memory_budget_mb * MiB)


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cache = ArtifactCache(args.cache_dir)
    agent = Agent(
        args.platform,
        args.token,
        cache,
        threads=args.threads,
        name=args.name,
        deployment=args.deployment,
        memory_budget_bytes=memory_budget_bytes(args),
        cold_after_s=args.cold_after_s,
    )
    beating = asyncio.create_task(beat_alive(args.alive_file, agent)) if args.alive_file else None
    try:
        await agent.run(stop)
    finally:
        if beating is not None:
            beating.cancel()
        cache.close()
    logging.getLogger(__name__).info("stopped")


ALIVE_EVERY_S = 5.0


async def beat_alive(path: str, agent: Agent) -> None:
    """Refresh the heartbeat file from the event loop that serves requests, so a blocked loop
    stops refreshing it (the liveness probe, scripts/probe_alive.py); ready while the agent's
    websocket to the platform is open (readiness). One rename per beat: a probe never reads half
    a line."""
    partial = f"{path}.partial"
    while True:
        connected = agent.connection.socket is not None
        with open(partial, "w") as f:
            f.write("ready\n" if connected else "not ready: not connected to the platform\n")
        os.replace(partial, path)
        await asyncio.sleep(ALIVE_EVERY_S)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Keep the imported heap (numpy, onnxruntime, pydantic) out of full GC collections, which
    # otherwise show up as tail latency under load (as measured on the gateway).
    gc.freeze()
    telemetry.configure()  # off unless OTEL_TRACES_EXPORTER says otherwise (docs/observability.md)
    run(serve(args))
    return 0


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run the agent on uvloop where it is installed, else on asyncio's own loop. uvloop's
    loop is C: the server side's CPU per request was 1.18x at 64 connections and 1.84x at one
    with the agent on asyncio's loop (paired rounds, bench/README.md, "The gateway's own
    cost")."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


if __name__ == "__main__":
    sys.exit(main())
