"""What grouping a turn's requests into one agent frame saves, on the dispatch path alone.

The gateway's real ``AgentPool`` and the agent's real ``Serving`` and ``Batcher``, back to back
in one event loop (the bytes that would cross the websocket cross a function call), serving a
model that costs nothing (it returns its input), so that what is timed is the platform's own
work per request both sides of the socket: framing, dispatch, the agent's checks, queue and
replies. Each round sends ``turn`` requests of one caller at once and waits for all of them,
with grouping on and off in alternate rounds; CPU time (``time.process_time``) per request.
Run: ``.venv/bin/python bench/group_bench.py [--turns 1,4,16,64] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.dispatch import AgentLink, AgentPool  # noqa: E402
from serving_agent import Batcher, FunctionRuntime  # noqa: E402
from serving_agent._serving import Serving  # noqa: E402
from serving_agent._versions import Loaded  # noqa: E402
from serving_agent.protocol import TensorSpec, VersionSpec, unpack_frames  # noqa: E402

FEATURES = 32  # the demo fraud MLP's input width


class Wire:
    """The pool's link and the agent's serving, back to back."""

    def __init__(self, groups: bool) -> None:
        spec = VersionSpec(
            version_id=1,
            model="m",
            version=1,
            sha256="0" * 64,
            artifact_url="/unused",
            inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1, FEATURES])],
            outputs=[TensorSpec(name="y", datatype="FP32", shape=[-1, 2])],
        )
        runtime = FunctionRuntime(lambda inputs: [inputs["x"][:, :2]], ["x"], ["y"])
        self.pool = AgentPool()
        self.link = AgentLink("agent", self._to_agent, groups=groups)
        self.pool.add(self.link)
        self.pool.set_ready(self.link, 1, True)
        loaded = Loaded(spec, runtime, Batcher(runtime, inline=True))
        self.serving = Serving({1: loaded}, self)

    async def _to_agent(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            self.serving.handle_frame(frame)

    async def send_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.pool.deliver(self.link, frame)

    def stream_sender(self) -> Any:
        raise AssertionError


async def one_round(groups: bool, turn: int, requests: int) -> float:
    """CPU µs per request for ``requests`` requests sent ``turn`` at a time."""
    wire = Wire(groups)
    x = np.random.default_rng(0).random((1, FEATURES), dtype=np.float32)

    async def infer() -> Any:
        return await wire.pool.infer(1, ["x"], [x], None, 5.0, key=1, max_rows=32)

    for _ in range(20):  # warm
        await asyncio.gather(*(infer() for _ in range(turn)))
    started = time.process_time()
    for _ in range(requests // turn):
        await asyncio.gather(*(infer() for _ in range(turn)))
    return (time.process_time() - started) / (requests // turn * turn) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=6400)
    args = parser.parse_args()
    rows = []
    for turn in (int(t) for t in args.turns.split(",")):
        alone, grouped = [], []
        for _ in range(args.rounds):
            alone.append(asyncio.run(one_round(False, turn, args.requests)))
            grouped.append(asyncio.run(one_round(True, turn, args.requests)))
        ratios = [a / g for a, g in zip(alone, grouped, strict=True)]
        rows.append(
            (turn, statistics.median(alone), statistics.median(grouped), statistics.median(ratios))
        )
    print(
        f"Dispatch path only (gateway pool + agent serving, a model that costs nothing), "
        f"median of {args.rounds} paired rounds, CPU µs per request:\n"
    )
    print("| requests per turn | one frame each | grouped | saved (ratio) |")
    print("| --- | --- | --- | --- |")
    for turn, a, g, r in rows:
        print(f"| {turn} | {a:.1f} | {g:.1f} | {r:.2f}x |")


if __name__ == "__main__":
    main()
