"""The dynamic batcher, over an in-memory runtime that records every run."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from serving_agent import BadInput, Batcher, FunctionRuntime, NotLoaded, Overloaded

pytestmark = pytest.mark.anyio


def doubling(runs: list[int], delay_s: float = 0.0) -> FunctionRuntime:
    """A model that doubles x; ``runs`` collects each run's batch size."""

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        runs.append(len(inputs["x"]))
        time.sleep(delay_s)
        return [inputs["x"] * 2]

    return FunctionRuntime(run, ["x"], ["y"])


def rows(n: int, start: float = 0.0, width: int = 4) -> dict[str, np.ndarray]:
    values = np.arange(start, start + n * width, dtype=np.float32)
    return {"x": values.reshape(n, width)}


async def test_concurrent_requests_run_as_one_batch_and_split_back() -> None:
    runs: list[int] = []
    batcher = Batcher(doubling(runs), max_batch_size=16, inline=True)
    requests = [rows(1, 0), rows(2, 100), rows(3, 200)]
    async with asyncio.timeout(5):
        results = await asyncio.gather(*(batcher.infer(r) for r in requests))
    assert runs == [6]
    for request, (y,) in zip(requests, results, strict=True):
        np.testing.assert_array_equal(y, request["x"] * 2)
    await batcher.stop()


async def test_worker_thread_batcher_splits_back_too() -> None:
    runs: list[int] = []
    batcher = Batcher(doubling(runs), max_batch_size=16, inline=False)
    requests = [rows(2, 0), rows(1, 100)]
    async with asyncio.timeout(5):
        results = await asyncio.gather(*(batcher.infer(r) for r in requests))
    assert runs == [3]
    for request, (y,) in zip(requests, results, strict=True):
        np.testing.assert_array_equal(y, request["x"] * 2)
    await batcher.stop()


async def test_batches_hold_at_most_max_batch_size_rows() -> None:
    runs: list[int] = []
    batcher = Batcher(doubling(runs), max_batch_size=4, inline=True)
    async with asyncio.timeout(5):
        await asyncio.gather(*(batcher.infer(rows(3)) for _ in range(3)))
    assert runs == [3, 3, 3]
    await batcher.stop()


async def test_full_queue_answers_overloaded_at_once() -> None:
    batcher = Batcher(doubling([]), max_queue=2, inline=True)
    async with asyncio.timeout(5):
        results = await asyncio.gather(
            *(batcher.infer(rows(1)) for _ in range(3)), return_exceptions=True
        )
    assert isinstance(results[2], Overloaded)
    assert not isinstance(results[0], Exception) and not isinstance(results[1], Exception)
    await batcher.stop()


async def test_a_failing_run_fails_every_future_in_the_batch() -> None:
    def boom(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        raise RuntimeError("boom")

    batcher = Batcher(FunctionRuntime(boom, ["x"], ["y"]), inline=True)
    async with asyncio.timeout(5):
        results = await asyncio.gather(
            *(batcher.infer(rows(1)) for _ in range(3)), return_exceptions=True
        )
    assert all(isinstance(r, RuntimeError) and str(r) == "boom" for r in results)
    await batcher.stop()


async def test_a_run_returning_the_wrong_batch_size_fails_every_future() -> None:
    def first_row_only(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [inputs["x"][:1]]

    batcher = Batcher(FunctionRuntime(first_row_only, ["x"], ["y"]), inline=True)
    async with asyncio.timeout(5):
        results = await asyncio.gather(
            batcher.infer(rows(1)), batcher.infer(rows(2)), return_exceptions=True
        )
    assert all(isinstance(r, RuntimeError) and "expected 3 rows" in str(r) for r in results)
    await batcher.stop()


async def test_a_lone_request_runs_at_once_without_queue_delay() -> None:
    batcher = Batcher(doubling([]), max_queue_delay_ms=0, inline=True)
    started = time.perf_counter()
    async with asyncio.timeout(5):
        await batcher.infer(rows(1))
    assert time.perf_counter() - started < 0.05
    await batcher.stop()


async def test_queue_delay_waits_for_more_requests_to_fill_the_batch() -> None:
    runs: list[int] = []
    batcher = Batcher(doubling(runs), max_queue_delay_ms=200, inline=True)

    async def late() -> list[np.ndarray]:
        await asyncio.sleep(0.02)
        return await batcher.infer(rows(1))

    started = time.perf_counter()
    async with asyncio.timeout(5):
        await asyncio.gather(batcher.infer(rows(1)), late())
    assert runs == [2]
    assert time.perf_counter() - started >= 0.2  # a batch that is not full waits out the delay
    await batcher.stop()


async def test_requests_with_different_non_batch_shapes_run_separately() -> None:
    runs: list[int] = []
    batcher = Batcher(doubling(runs), inline=True)
    async with asyncio.timeout(5):
        short, long = await asyncio.gather(
            batcher.infer(rows(1, width=3)), batcher.infer(rows(2, width=5))
        )
    assert sorted(runs) == [1, 2]
    assert short[0].shape == (1, 3) and long[0].shape == (2, 5)
    await batcher.stop()


async def test_a_request_larger_than_max_batch_size_runs_alone() -> None:
    runs: list[int] = []
    batcher = Batcher(doubling(runs), max_batch_size=2, inline=True)
    async with asyncio.timeout(5):
        big, small = await asyncio.gather(batcher.infer(rows(3)), batcher.infer(rows(1)))
    assert runs == [3, 1]
    assert big[0].shape == (3, 4) and small[0].shape == (1, 4)
    await batcher.stop()


async def test_inputs_that_disagree_on_rows_are_bad_input() -> None:
    batcher = Batcher(doubling([]), inline=True)
    with pytest.raises(BadInput, match="same batch dimension"):
        await batcher.infer({"x": np.zeros((2, 4), np.float32), "m": np.zeros((3, 1), np.float32)})
    await batcher.stop()


async def test_stop_fails_waiting_requests_with_not_loaded() -> None:
    release = threading.Event()

    def blocked(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        release.wait(5)
        return [inputs["x"]]

    batcher = Batcher(FunctionRuntime(blocked, ["x"], ["y"]), inline=False)
    running = asyncio.create_task(batcher.infer(rows(1)))
    await asyncio.sleep(0.05)  # the first request is now running in the worker thread
    waiting = asyncio.create_task(batcher.infer(rows(1)))
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await batcher.stop()
        results = await asyncio.gather(running, waiting, return_exceptions=True)
    release.set()
    assert all(isinstance(r, NotLoaded) for r in results)
    with pytest.raises(NotLoaded):
        await batcher.infer(rows(1))


async def test_slow_models_run_off_the_event_loop_and_fast_ones_inline() -> None:
    threads: list[int] = []

    def record(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        threads.append(threading.get_ident())
        return [inputs["x"]]

    for inline in (True, False):
        batcher = Batcher(FunctionRuntime(record, ["x"], ["y"]), inline=inline)
        async with asyncio.timeout(5):
            await batcher.infer(rows(1))
        await batcher.stop()
    assert threads[0] == threading.get_ident()
    assert threads[1] != threading.get_ident()
