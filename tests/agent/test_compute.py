"""What model runs cost, as the agent measures it for usage: CPU-seconds (every thread of the
runtime), accelerator-seconds, runs, rows, run time and queue wait, per version."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from serving_agent import Agent, ArtifactCache, Batcher, FunctionRuntime
from serving_agent._compute import ComputeMeter, RunTotals
from serving_agent._versions import Loaded
from serving_agent.protocol import VersionSpec

pytestmark = pytest.mark.anyio

# A run that burns a known CPU time is charged that time, plus what the event loop and the
# thread hop spend around it (well under this on any machine), never less.
TOLERANCE_S = 0.08


def burn(seconds: float) -> None:
    """Spin this thread until it has used ``seconds`` of CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def burning(seconds_per_thread: float, threads: int, provider: str = "python") -> FunctionRuntime:
    """A model whose run keeps ``threads`` threads busy (as an intra-op pool would), each for
    ``seconds_per_thread`` of CPU time, and answers x back."""

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        pool = [threading.Thread(target=burn, args=(seconds_per_thread,)) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        return [inputs["x"]]

    return FunctionRuntime(run, ["x"], ["y"], provider=provider)


def rows(n: int) -> dict[str, np.ndarray]:
    return {"x": np.zeros((n, 2), dtype=np.float32)}


async def test_a_run_is_charged_the_cpu_time_of_every_thread_it_used() -> None:
    batcher = Batcher(burning(0.15, threads=2), max_batch_size=16, inline=False)
    async with asyncio.timeout(10):
        await batcher.infer(rows(3))
    totals = batcher.totals
    assert 0.30 <= totals.cpu_s <= 0.30 + TOLERANCE_S
    assert (totals.runs, totals.rows) == (1, 3)
    assert totals.run_s > 0
    assert totals.accel_s == 0.0  # a CPU provider
    await batcher.stop()


async def test_one_batch_of_several_requests_is_one_run_with_all_their_rows() -> None:
    batcher = Batcher(burning(0.05, threads=1), max_batch_size=16, inline=True)
    async with asyncio.timeout(10):
        await asyncio.gather(batcher.infer(rows(2)), batcher.infer(rows(3)))
    totals = batcher.totals
    assert (totals.runs, totals.rows) == (1, 5)
    assert 0.05 <= totals.cpu_s <= 0.05 + TOLERANCE_S
    assert totals.queue_wait_s >= 0.0
    await batcher.stop()


async def test_queue_wait_sums_the_time_each_request_waited_for_its_run() -> None:
    batcher = Batcher(burning(0.1, threads=1), max_batch_size=1, inline=False)
    async with asyncio.timeout(10):
        await asyncio.gather(batcher.infer(rows(1)), batcher.infer(rows(1)))
    # The second request waited for the first run (0.1 s of CPU at least).
    assert batcher.totals.queue_wait_s >= 0.09
    assert batcher.totals.runs == 2
    await batcher.stop()


async def test_runs_on_a_cuda_provider_count_their_wall_time_as_accelerator_seconds() -> None:
    batcher = Batcher(
        burning(0.02, threads=1, provider="CUDAExecutionProvider"), max_batch_size=4, inline=True
    )
    async with asyncio.timeout(10):
        await batcher.infer(rows(1))
    assert batcher.totals.accel_s == pytest.approx(batcher.totals.run_s)
    assert batcher.totals.accel_s >= 0.02
    await batcher.stop()


async def test_a_failed_run_is_still_charged() -> None:
    def failing(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        burn(0.03)
        raise RuntimeError("boom")

    batcher = Batcher(FunctionRuntime(failing, ["x"], ["y"]), inline=True)
    with pytest.raises(RuntimeError):
        await batcher.infer(rows(2))
    assert batcher.totals.runs == 1
    assert batcher.totals.cpu_s >= 0.03
    await batcher.stop()


def test_cpu_time_between_readings_is_split_evenly_between_the_runs_in_progress() -> None:
    clock = [0.0]
    meter = ComputeMeter(lambda: clock[0])
    a, b = RunTotals(), RunTotals()
    a_started = meter.start(a)
    clock[0] += 1.0  # a alone
    b_started = meter.start(b)
    clock[0] += 2.0  # a and b together: 1 each
    meter.stop(b, b_started, 2, "python")
    clock[0] += 0.5  # a alone again
    meter.stop(a, a_started, 4, "python")
    clock[0] += 7.0  # nothing runs: charged to nobody
    assert a.cpu_s == pytest.approx(2.5)
    assert b.cpu_s == pytest.approx(1.0)
    assert (a.rows, b.rows, a.runs, b.runs) == (4, 2, 1, 1)


def test_two_versions_with_equal_totals_are_still_told_apart() -> None:
    clock = [0.0]
    meter = ComputeMeter(lambda: clock[0])
    a, b = RunTotals(), RunTotals()
    a_started, b_started = meter.start(a), meter.start(b)
    clock[0] += 2.0
    meter.stop(b, b_started, 1, "python")
    meter.stop(a, a_started, 1, "python")
    clock[0] += 1.0
    b_started = meter.start(b)
    clock[0] += 1.0
    meter.stop(b, b_started, 1, "python")
    assert (a.cpu_s, b.cpu_s) == (pytest.approx(1.0), pytest.approx(2.0))


async def test_the_heartbeat_reports_each_versions_compute(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    spec = make_spec()
    agent = Agent("http://platform.test", "t", ArtifactCache(tmp_path / "cache"), name="n")
    runtime = burning(0.05, threads=2)
    batcher = Batcher(runtime, inline=True, meter=agent.versions.meter)
    agent.versions.loaded[spec.version_id] = Loaded(spec, runtime, batcher)
    async with asyncio.timeout(10):
        await batcher.infer(rows(4))
    (load,) = agent.heartbeat().versions
    assert 0.10 <= load.cpu_s_total <= 0.10 + TOLERANCE_S
    assert (load.runs_total, load.run_rows_total, load.accel_s_total) == (1, 4, 0.0)
    assert load.run_s_total > 0 and load.queue_wait_s_total >= 0
    await batcher.stop()
