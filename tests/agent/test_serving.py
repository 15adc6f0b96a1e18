"""Request serving alone: a plain dict of loaded versions on one side, a sender that records the
reply frames on the other."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from serving_agent import BadInput, Batcher, FunctionRuntime, Overloaded
from serving_agent._serving import Serving, Stats, error_reply, peek_request_id
from serving_agent._versions import Loaded, LoadedTextGen
from serving_agent.protocol import (
    CancelGenerate,
    GenerateRequest,
    InferError,
    InferResult,
    VersionSpec,
    decode_frame,
    encode_frame,
)
from tests.agent.conftest import infer_frame

pytestmark = pytest.mark.anyio

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class RecordingSender:
    """Keeps every reply frame; a stream's sender is its own method, so it can be told apart."""

    def __init__(self) -> None:
        self.frames: asyncio.Queue[bytes] = asyncio.Queue()

    async def send_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.frames.put_nowait(frame)

    async def stream_frames(self, frames: list[bytes]) -> None:
        await self.send_frames(frames)

    def stream_sender(self) -> Callable[[list[bytes]], Any]:
        return self.stream_frames

    async def replies(self, count: int) -> list[Any]:
        """The headers of the next ``count`` reply frames."""
        async with asyncio.timeout(5):
            return [decode_frame(await self.frames.get())[0] for _ in range(count)]


class FakeEngine:
    """Takes streams and cancels as a textgen engine would, without generating anything."""

    provider = "fake"
    streams_active = 0

    def __init__(self, refuses: Exception | None = None) -> None:
        self.refuses = refuses
        self.submitted: list[tuple[GenerateRequest, Any]] = []
        self.cancelled: list[int] = []
        self.all_cancelled: list[set] = []  # the senders of each cancel_all

    def submit(self, request: GenerateRequest, send: Any, received: float) -> None:
        if self.refuses is not None:
            raise self.refuses
        self.submitted.append((request, send))

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    def cancel_all(self, senders: Any = None) -> None:
        self.all_cancelled.append(set(senders))


def doubling(spec: VersionSpec, gate: threading.Event | None = None) -> Loaded:
    """A loaded version that doubles its input's first two columns (after ``gate``, if any)."""

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        if gate is not None:
            gate.wait(10)
        return [inputs["x"][:, :2] * 2]

    runtime = FunctionRuntime(run, ["x"], ["y"])
    return Loaded(spec, runtime, Batcher(runtime, inline=gate is None))


def serving_with(*loaded: Loaded | LoadedTextGen) -> tuple[Serving, RecordingSender]:
    sender = RecordingSender()
    return Serving({v.spec.version_id: v for v in loaded}, sender), sender


def generate_frame(request_id: int, version_id: int = 2) -> bytes:
    return encode_frame(GenerateRequest(id=request_id, version_id=version_id, prompt="Call me"))


def test_peek_request_id_reads_the_header_of_a_broken_frame() -> None:
    frame = infer_frame(42, np.zeros((1, 4), np.float32))
    assert peek_request_id(frame[:-4]) == 42
    assert peek_request_id(b"\x00\x00") is None
    assert peek_request_id(b"\x00\x00\x00\x02{}") is None


def test_an_agent_error_keeps_its_code_and_anything_else_is_internal_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert decode_frame(error_reply(1, Overloaded("queue full")))[0] == InferError(
        id=1, code="overloaded", message="queue full"
    )
    assert caplog.records == []
    assert decode_frame(error_reply(2, KeyError()))[0] == InferError(
        id=2, code="internal", message="KeyError"
    )
    assert "request 2 failed: KeyError()" in caplog.text


def test_load_avg_is_the_time_requests_spent_over_the_time_that_passed() -> None:
    now = [100.0]
    stats = Stats(clock=lambda: now[0])
    # Over 2 s, 400 requests of 10 ms each: 2 requests in the agent on average, although a
    # look at any instant may well find none.
    for _ in range(400):
        stats.record(0.010, ok=True)
    now[0] += 2.0
    assert stats.load_avg() == pytest.approx(2.0)
    now[0] += 1.0  # a quiet second: the window starts afresh
    assert stats.load_avg() == 0.0


# Inference -------------------------------------------------------------------------------------


async def test_a_request_is_answered_with_its_result_and_counted(
    make_spec: Callable[..., VersionSpec],
) -> None:
    loaded = doubling(make_spec())
    serving, sender = serving_with(loaded)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    serving.handle_frame(infer_frame(5, x))
    frame = await asyncio.wait_for(sender.frames.get(), 5)
    header, (y,) = decode_frame(frame)
    assert isinstance(header, InferResult) and header.id == 5
    np.testing.assert_array_equal(y, x[:, :2] * 2)
    assert header.queue_ms >= 0 and header.compute_ms > 0
    await asyncio.sleep(0)  # the reply is recorded once it has been sent
    stats = serving.stats
    assert (stats.requests_total, stats.errors_total, stats.in_flight) == (1, 0, 0)
    assert stats.percentiles_ms()[0] > 0
    assert (loaded.usage.requests_total, loaded.usage.in_flight) == (1, 0)
    assert loaded.usage.last_used is not None


async def test_a_failed_request_is_logged_with_the_platforms_trace(
    make_spec: Callable[..., VersionSpec], caplog: pytest.LogCaptureFixture
) -> None:
    serving, sender = serving_with(doubling(make_spec()))
    with caplog.at_level("INFO", logger="serving_agent"):
        serving.handle_frame(infer_frame(9, np.zeros((1, 3), np.float32), trace=TRACE))
        await sender.replies(1)
    assert any(TRACE in r.getMessage() and "request 9" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (infer_frame(1, np.zeros((1, 4), np.float32), version_id=99), "not_loaded"),
        (infer_frame(1, np.zeros((1, 3), np.float32)), "bad_input"),
        (infer_frame(1, np.zeros((1, 4), np.float64)), "bad_input"),
        (infer_frame(1, np.zeros((1, 4), np.float32), outputs=["nope"]), "bad_input"),
        (infer_frame(1, np.zeros((1, 4), np.float32))[:-1], "bad_input"),  # truncated tensor
        (infer_frame(1, np.zeros((1, 4), np.float32), version_id=2), "bad_input"),  # textgen
    ],
)
async def test_a_request_that_cannot_run_gets_an_error_frame(
    make_spec: Callable[..., VersionSpec], frame: bytes, code: str
) -> None:
    textgen = LoadedTextGen(make_spec(version_id=2), FakeEngine())
    serving, sender = serving_with(doubling(make_spec()), textgen)
    serving.handle_frame(frame)
    (header,) = await sender.replies(1)
    assert isinstance(header, InferError)
    assert (header.id, header.code) == (1, code)
    await asyncio.sleep(0)
    assert serving.stats.errors_total == 1


async def test_an_overloaded_version_answers_overloaded(
    make_spec: Callable[..., VersionSpec],
) -> None:
    loaded = doubling(make_spec())
    loaded.batcher.max_queue = 1
    serving, sender = serving_with(loaded)
    for request_id in (1, 2):
        serving.handle_frame(infer_frame(request_id, np.zeros((1, 4), np.float32)))
    codes = {r.id: getattr(r, "code", "ok") for r in await sender.replies(2)}
    assert codes == {1: "ok", 2: "overloaded"}


async def test_requests_of_one_turn_share_a_batch(make_spec: Callable[..., VersionSpec]) -> None:
    loaded = doubling(make_spec())
    serving, sender = serving_with(loaded)
    xs = [np.full((1, 4), i, np.float32) for i in range(3)]
    for i, x in enumerate(xs):
        serving.handle_frame(infer_frame(i, x))
    replies = [decode_frame(await asyncio.wait_for(sender.frames.get(), 5)) for _ in xs]
    assert [header.id for header, _ in replies] == [0, 1, 2]
    for (_, (y,)), x in zip(replies, xs, strict=True):
        np.testing.assert_array_equal(y, x[:, :2] * 2)
    assert loaded.batcher.runs == 1


async def test_a_frame_without_a_header_is_ignored(make_spec: Callable[..., VersionSpec]) -> None:
    serving, sender = serving_with(doubling(make_spec()))
    serving.handle_frame(b"\x00\x00\x00\x09{}")
    await asyncio.sleep(0.01)
    assert sender.frames.empty()


async def test_a_dropped_connection_cancels_the_requests_in_flight(
    make_spec: Callable[..., VersionSpec],
) -> None:
    gate = threading.Event()
    loaded = doubling(make_spec(), gate)
    serving, sender = serving_with(loaded)
    try:
        serving.handle_frame(infer_frame(1, np.zeros((1, 4), np.float32)))
        async with asyncio.timeout(5):
            while loaded.usage.in_flight == 0:
                await asyncio.sleep(0.01)
        serving.drop_connection()
        await serving.shutdown()
        assert (serving.stats.in_flight, loaded.usage.in_flight) == (0, 0)
        assert sender.frames.empty()  # the platform fails it; nobody here would read a reply
    finally:
        gate.set()
        await loaded.batcher.stop()


# Generation ------------------------------------------------------------------------------------


async def test_a_generate_frame_goes_to_its_versions_engine_with_this_connections_sender(
    make_spec: Callable[..., VersionSpec],
) -> None:
    engine = FakeEngine()
    textgen = LoadedTextGen(make_spec(version_id=2), engine)
    serving, sender = serving_with(textgen)
    serving.handle_frame(generate_frame(3))
    ((request, send),) = engine.submitted
    assert request.id == 3 and send == sender.stream_frames
    assert textgen.usage.requests_total == 1 and textgen.usage.last_used is not None


@pytest.mark.parametrize(
    ("version_id", "refuses", "code"),
    [
        (99, None, "not_loaded"),
        (1, None, "bad_input"),  # an ONNX version does not generate
        (2, Overloaded("16 streams already generating"), "overloaded"),
        (2, BadInput("prompt too long"), "bad_input"),
    ],
)
async def test_a_stream_that_cannot_start_gets_an_error_frame(
    make_spec: Callable[..., VersionSpec],
    version_id: int,
    refuses: Exception | None,
    code: str,
) -> None:
    engine = FakeEngine(refuses)
    textgen = LoadedTextGen(make_spec(version_id=2), engine)
    serving, sender = serving_with(doubling(make_spec()), textgen)
    serving.handle_frame(generate_frame(3, version_id))
    (header,) = await sender.replies(1)
    assert isinstance(header, InferError) and (header.id, header.code) == (3, code)
    assert engine.submitted == []


async def test_cancel_frames_reach_the_engines_and_a_dropped_connection_cancels_every_stream(
    make_spec: Callable[..., VersionSpec],
) -> None:
    engines = [FakeEngine(), FakeEngine()]
    serving, _ = serving_with(
        *(LoadedTextGen(make_spec(version_id=i), e) for i, e in enumerate(engines, 2))
    )
    serving.handle_frame(encode_frame(CancelGenerate(id=5)))
    assert [e.cancelled for e in engines] == [[5], [5]]
    serving.handle_frame(generate_frame(6, version_id=2))
    serving.drop_connection()
    (send,) = {send for _, send in engines[0].submitted}
    # Only this connection's streams: a data link to another gateway keeps its own.
    assert all(e.all_cancelled == [{send}] for e in engines)
