"""The batcher's scheduler alone: priority classes, caller fairness, caps, shedding, deadlines
and cancels, over an in-memory model held shut by a gate so that requests queue up behind it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable
from typing import Any

import numpy as np
import pytest

from serving_agent import Batcher, Cancelled, Expired, FunctionRuntime, Overloaded, OverShare
from serving_agent._serving import Serving
from serving_agent._versions import Loaded
from serving_agent.protocol import (
    BATCH,
    CRITICAL,
    INTERACTIVE,
    SHADOW,
    CancelGenerate,
    InferError,
    InferRequest,
    VersionSpec,
    decode_frame,
    encode_frame,
    tensor_of,
)
from tests.agent.conftest import infer_frame

pytestmark = pytest.mark.anyio


class Gated:
    """A model that records the first value of each request it runs, in order, and holds every
    run until ``gate`` is set (it runs on the batcher's worker thread, off the event loop)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.order: list[int] = []
        self.started = threading.Event()

    def runtime(self) -> FunctionRuntime:
        def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
            self.started.set()
            self.gate.wait(10)
            self.order.extend(int(v) for v in inputs["x"][:, 0])
            return [inputs["x"] * 2]

        return FunctionRuntime(run, ["x"], ["y"])


def x(value: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 2), value, np.float32)}


async def blocked(model: Gated, **kw: Any) -> tuple[Batcher, asyncio.Task[Any]]:
    """A batcher (one request per run) whose first run, of value -1, holds the model."""
    batcher = Batcher(model.runtime(), max_batch_size=1, **kw)
    first = asyncio.create_task(batcher.infer_timed(x(-1), caller=99))
    while not model.started.is_set():
        await asyncio.sleep(0.001)
    return batcher, first


def submit(batcher: Batcher, value: int, **kw: Any) -> asyncio.Task[Any]:
    return asyncio.ensure_future(batcher.infer_timed(x(value), **kw))


async def settle(*tasks: Awaitable[Any]) -> list[Any]:
    async with asyncio.timeout(10):
        return await asyncio.gather(*tasks, return_exceptions=True)


async def queued(*tasks: asyncio.Task[Any]) -> None:
    """Let the tasks reach the queue (each queues on its first step)."""
    del tasks
    await asyncio.sleep(0.01)


async def test_a_better_class_runs_first_whatever_the_arrival_order() -> None:
    model = Gated()
    batcher, first = await blocked(model)
    tasks = [
        submit(batcher, 3, priority=SHADOW),
        submit(batcher, 2, priority=BATCH),
        submit(batcher, 1, priority=INTERACTIVE),
        submit(batcher, 0, priority=CRITICAL),
    ]
    await queued(*tasks)
    model.gate.set()
    await settle(first, *tasks)
    assert model.order == [-1, 0, 1, 2, 3]
    await batcher.stop()


async def test_callers_of_one_class_take_turns_so_a_flood_does_not_starve_the_calm() -> None:
    model = Gated()
    batcher, first = await blocked(model, max_queue=64, max_queue_per_caller=64)
    flood = [submit(batcher, 100 + i, caller=1) for i in range(20)]
    await queued(*flood)
    calm = [submit(batcher, 200 + i, caller=2) for i in range(3)]
    await queued(*calm)
    model.gate.set()
    await settle(first, *flood, *calm)
    # The calm caller's requests alternate with the flood's instead of waiting behind all 20.
    assert model.order[:7] == [-1, 100, 200, 101, 201, 102, 202]
    assert sorted(model.order[7:]) == list(range(103, 120))
    await batcher.stop()


async def test_a_caller_over_its_cap_on_a_shared_version_is_refused_with_over_share() -> None:
    model = Gated()
    batcher, first = await blocked(model, max_queue=16, max_queue_per_caller=3)
    mine = [submit(batcher, i, caller=1) for i in range(5)]
    await queued(*mine)
    results = await settle(first, *mine, release(model))
    # Tenant 99's running request shares the version: caller 1 holds at most 3.
    assert [type(r) for r in results[1:6]].count(OverShare) == 2
    assert isinstance(results[4], OverShare) and isinstance(results[5], OverShare)
    assert batcher.counts.shed == 2
    await batcher.stop()


async def test_a_caller_alone_may_use_the_whole_queue() -> None:
    model = Gated()
    batcher = Batcher(model.runtime(), max_batch_size=1, max_queue=8, max_queue_per_caller=2)
    mine = [submit(batcher, i, caller=1) for i in range(8)]
    await queued(*mine)
    results = await settle(*mine, release(model))
    assert not any(isinstance(r, Exception) for r in results)
    await batcher.stop()


async def test_shadow_copies_are_capped_at_an_eighth_of_the_queue() -> None:
    model = Gated()
    batcher, first = await blocked(model, max_queue=16)
    shadows = [submit(batcher, i, priority=SHADOW, caller=1) for i in range(4)]
    await queued(*shadows)
    results = await settle(first, *shadows, release(model))
    refused = [r for r in results[1:5] if isinstance(r, Overloaded)]
    assert len(refused) == 2  # 16 / 8
    assert "shadow" in str(refused[0])
    await batcher.stop()


async def test_a_full_queue_sheds_the_worst_class_first_for_better_work() -> None:
    model = Gated()
    batcher, first = await blocked(model, max_queue=3, max_queue_per_caller=3)
    low = [submit(batcher, 10 + i, priority=BATCH, caller=1) for i in range(3)]
    await queued(*low)
    urgent = submit(batcher, 0, priority=CRITICAL, caller=2)
    await queued(urgent)
    results = await settle(first, *low, urgent, release(model))
    # The newest batch request made room; the critical one ran right after the blocker.
    assert isinstance(results[3], Overloaded) and not isinstance(results[3], OverShare)
    assert not isinstance(results[4], Exception)
    assert model.order == [-1, 0, 10, 11]
    assert batcher.counts.shed == 1
    await batcher.stop()


async def test_a_full_queue_sheds_the_caller_holding_most_of_it_for_another_caller() -> None:
    model = Gated()
    batcher, first = await blocked(model, max_queue=4, max_queue_per_caller=8)
    flood = [submit(batcher, 10 + i, caller=1) for i in range(4)]
    await queued(*flood)
    calm = submit(batcher, 0, caller=2)
    await queued(calm)
    results = await settle(first, *flood, calm, release(model))
    assert isinstance(results[4], OverShare)  # the flood's newest
    assert not isinstance(results[5], Exception)
    await batcher.stop()


async def test_the_least_worthy_newcomer_to_a_full_queue_is_refused() -> None:
    model = Gated()
    batcher, first = await blocked(model, max_queue=2, max_queue_per_caller=8)
    queued_now = [submit(batcher, i, caller=1, priority=CRITICAL) for i in range(2)]
    await queued(*queued_now)
    late = submit(batcher, 5, caller=2, priority=BATCH)
    results = await settle(first, *queued_now, late, release(model))
    assert isinstance(results[3], Overloaded)
    assert "queue full" in str(results[3])
    await batcher.stop()


async def test_a_request_past_its_deadline_is_dropped_before_compute() -> None:
    model = Gated()
    batcher, first = await blocked(model)
    stale = submit(batcher, 1, deadline=time.monotonic() + 0.05)
    fresh = submit(batcher, 2, deadline=time.monotonic() + 60)
    await asyncio.sleep(0.1)
    model.gate.set()
    results = await settle(first, stale, fresh)
    assert isinstance(results[1], Expired)
    assert model.order == [-1, 2]  # 1 never ran
    assert batcher.counts.expired == 1
    await batcher.stop()


async def test_a_request_arriving_past_its_deadline_is_refused_at_once() -> None:
    batcher = Batcher(Gated().runtime(), inline=True)
    with pytest.raises(Expired):
        await batcher.infer_timed(x(1), deadline=time.monotonic() - 1)
    assert batcher.counts.expired == 1 and batcher.depth == 0
    await batcher.stop()


async def test_cancel_removes_queued_work_that_then_never_runs() -> None:
    model = Gated()
    batcher, first = await blocked(model)
    doomed = submit(batcher, 1, request_id=41)
    kept = submit(batcher, 2, request_id=42)
    await queued(doomed, kept)
    assert batcher.cancel(41) is True
    assert batcher.cancel(41) is False  # gone already
    assert batcher.depth == 1
    model.gate.set()
    results = await settle(first, doomed, kept)
    assert isinstance(results[1], Cancelled)
    assert model.order == [-1, 2]
    assert batcher.counts.cancelled == 1
    await batcher.stop()


async def test_a_caller_cancelled_while_queued_leaves_no_trace_in_the_queue() -> None:
    model = Gated()
    batcher, first = await blocked(model, max_queue=4, max_queue_per_caller=1)
    waiting = submit(batcher, 1, caller=1)
    await queued(waiting)
    waiting.cancel()
    await settle(waiting)
    assert batcher.depth == 0
    # Its caller's share is free again.
    again = submit(batcher, 2, caller=1)
    model.gate.set()
    results = await settle(first, again)
    assert not isinstance(results[1], Exception)
    await batcher.stop()


async def release(model: Gated) -> None:
    """Open the gate once every task of this gather has queued."""
    await asyncio.sleep(0.02)
    model.gate.set()


# Through the agent's serving: frames carry caller, class and budget; cancel frames remove.


class Replies:
    def __init__(self) -> None:
        self.frames: asyncio.Queue[bytes] = asyncio.Queue()

    async def send_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.frames.put_nowait(frame)

    def stream_sender(self) -> Any:
        return self.send_frames

    async def codes(self, count: int) -> dict[int, str]:
        async with asyncio.timeout(5):
            headers = [decode_frame(await self.frames.get())[0] for _ in range(count)]
        return {h.id: h.code if isinstance(h, InferError) else "ok" for h in headers}


def gated_version(spec: VersionSpec, model: Gated) -> Loaded:
    runtime = model.runtime()
    return Loaded(spec, runtime, Batcher(runtime, max_batch_size=1))


async def test_frames_carry_budget_and_cancel_and_every_id_gets_one_reply(
    make_spec: Any,
) -> None:
    model = Gated()
    spec = make_spec()
    loaded = gated_version(spec, model)
    replies = Replies()
    serving = Serving({spec.version_id: loaded}, replies)
    row = np.ones((1, 4), np.float32)
    serving.handle_frame(infer_frame(1, row))  # holds the model
    while not model.started.is_set():
        await asyncio.sleep(0.001)
    serving.handle_frame(infer_frame(2, row, budget_ms=30.0))
    serving.handle_frame(infer_frame(3, row))
    serving.handle_frame(infer_frame(4, row, priority=CRITICAL, tenant=7, key=3))
    await asyncio.sleep(0.05)
    serving.handle_frame(encode_frame(CancelGenerate(id=3)))
    assert await replies.codes(1) == {3: "cancelled"}
    model.gate.set()
    assert await replies.codes(3) == {1: "ok", 2: "expired", 4: "ok"}
    assert model.order.count(1) == 2  # requests 1 and 4 ran; 2 and 3 did not
    assert (loaded.batcher.counts.expired, loaded.batcher.counts.cancelled) == (1, 1)
    await loaded.batcher.stop()


def with_header(extra: bytes) -> bytes:
    """A valid infer frame (id 5, one row) whose JSON header ends with ``extra`` fields."""
    row = np.ones((1, 4), np.float32)
    frame = encode_frame(InferRequest(id=5, version_id=1, inputs=[tensor_of("x", row)]), [row])
    head_len = int.from_bytes(frame[:4], "big")
    head = frame[4 : 4 + head_len - 1] + b"," + extra + b"}"
    return len(head).to_bytes(4, "big") + head + frame[4 + head_len :]


@pytest.mark.parametrize(
    "extra",
    [
        b'"budget_ms":-5',
        b'"budget_ms":"soon"',
        b'"budget_ms":1e400',  # JSON's way to say infinity
        b'"priority":9',
        b'"priority":-1',
        b'"priority":"critical"',
        b'"tenant":-3',
        b'"key":-1',
    ],
)
async def test_a_frame_with_a_hostile_schedule_is_refused_as_bad_input(
    make_spec: Any, extra: bytes
) -> None:
    spec = make_spec()
    model = Gated()
    model.gate.set()
    replies = Replies()
    serving = Serving({spec.version_id: gated_version(spec, model)}, replies)
    serving.handle_frame(with_header(extra))
    assert await replies.codes(1) == {5: "bad_input"}
    assert model.order == []


async def test_a_budget_beyond_an_hour_is_clamped_and_served(make_spec: Any) -> None:
    spec = make_spec()
    model = Gated()
    model.gate.set()
    replies = Replies()
    loaded = gated_version(spec, model)
    serving = Serving({spec.version_id: loaded}, replies)
    serving.handle_frame(with_header(b'"budget_ms":1e300'))
    assert await replies.codes(1) == {5: "ok"}
    await loaded.batcher.stop()
