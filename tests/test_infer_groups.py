"""Grouped infer frames: a turn's requests of one caller for one version travel to the agent as
one frame and come back as one reply. The gateway's pool and the agent's ``Serving`` are the
real ones, wired back to back in one event loop (the websocket between them carries the same
bytes); what each request gets must be what it would get alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.dispatch import AgentLink, AgentPool, DispatchError
from serving_agent import Batcher, FunctionRuntime
from serving_agent._python import RowResults
from serving_agent._serving import Serving, result_frame
from serving_agent._versions import Loaded
from serving_agent.protocol import (
    CancelGenerate,
    InferError,
    InferRequest,
    InferResult,
    Member,
    TensorSpec,
    VersionSpec,
    decode_frame,
    encode_frame,
    tensor_of,
    unpack_frames,
)

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def spec(version_id: int, max_batch_size: int = 8) -> VersionSpec:
    return VersionSpec(
        version_id=version_id,
        model="m",
        version=1,
        sha256="0" * 64,
        artifact_url="/unused",
        inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1, 2])],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=[-1, 2])],
        max_batch_size=max_batch_size,
    )


def doubling(version_id: int, refuse_negative: bool = False) -> Loaded:
    """A version doubling its input; with ``refuse_negative``, rows with a negative first
    column fail on their own (as a python package's ``Partial`` reports them)."""

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        x = inputs["x"]
        if not refuse_negative:
            return [x * 2]
        errors = {int(r): "negative" for r in np.flatnonzero(x[:, 0] < 0)}
        return RowResults([x * 2], errors)

    runtime = FunctionRuntime(run, ["x"], ["y"])
    return Loaded(spec(version_id), runtime, Batcher(runtime, inline=True))


class Wire:
    """The pool's link and the agent's serving back to back: every message the gateway sends
    is unpacked into frames for the agent, every reply frame is delivered to the pool. The
    frames the agent got are kept, decoded."""

    def __init__(self, *loaded: Loaded, groups: bool = True) -> None:
        self.pool = AgentPool()
        self.link = AgentLink("agent", self._to_agent, groups=groups)
        self.pool.add(self.link)
        self.serving = Serving({v.spec.version_id: v for v in loaded}, self)
        for v in loaded:
            self.pool.set_ready(self.link, v.spec.version_id, True)
        self.seen: list[Any] = []
        self.hold = False  # while set, frames wait in ``held`` instead of reaching the agent
        self.held: list[bytes] = []

    async def _to_agent(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            self.seen.append(decode_frame(frame)[0])
            if self.hold:
                self.held.append(frame)
            else:
                self.serving.handle_frame(frame)

    def release(self) -> None:
        self.hold = False
        for frame in self.held:
            self.serving.handle_frame(frame)
        self.held.clear()

    async def send_frames(self, frames: list[bytes]) -> None:  # the agent's replies
        for frame in frames:
            self.pool.deliver(self.link, frame)

    def stream_sender(self) -> Callable[..., Any]:
        raise AssertionError("no streams here")

    def infer(
        self, x: np.ndarray, *, version_id: int = 1, key: int = 1, max_rows: int = 8, **kw: Any
    ) -> asyncio.Task[Any]:
        return asyncio.ensure_future(
            self.pool.infer(version_id, ["x"], [x], None, 5.0, key=key, max_rows=max_rows, **kw)
        )

    def infer_frames(self) -> list[InferRequest]:
        return [h for h in self.seen if isinstance(h, InferRequest)]


def rows(n: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(n * 2, dtype=np.float32).reshape(n, 2) + start).astype(np.float32)


def test_one_turns_requests_travel_as_one_frame_and_each_gets_its_own_rows() -> None:
    async def scenario() -> None:
        loaded = doubling(1)
        wire = Wire(loaded)
        xs = [rows(1, 0), rows(3, 10), rows(2, 20)]
        tasks = [wire.infer(x, trace=TRACE) for x in xs]
        replies = await asyncio.gather(*tasks)
        (frame,) = wire.infer_frames()
        assert [m.rows for m in frame.members] == [1, 3, 2]
        assert [m.trace for m in frame.members] == [TRACE] * 3
        assert frame.inputs[0].shape == [6, 2]
        for x, (header, (y,)) in zip(xs, replies, strict=True):
            assert isinstance(header, InferResult)
            np.testing.assert_array_equal(y, x * 2)
        # The agent ran one batch, and counts three requests, as it would have alone.
        assert loaded.batcher.runs == 1
        assert (loaded.usage.requests_total, wire.serving.stats.requests_total) == (3, 3)
        assert wire.link.pending == {} and wire.link.in_flight == {} and wire.link.member_of == {}

    asyncio.run(scenario())


def test_groups_keep_callers_versions_and_classes_apart_and_stay_within_the_batch_size() -> None:
    async def scenario() -> None:
        wire = Wire(doubling(1), doubling(2))
        calls = [
            dict(key=1),
            dict(key=2),  # another caller: its own frame (the agent shares a version by caller)
            dict(key=1, version_id=2),
            dict(key=1, priority=2),  # another class
            dict(key=1),
        ]
        tasks = [wire.infer(rows(3, i), max_rows=5, **kw) for i, kw in enumerate(calls)]
        tasks.append(wire.infer(rows(2, 9), key=1, max_rows=5))  # 3 + 2: fits the first
        tasks.append(wire.infer(rows(1, 7), key=1, max_rows=5))  # 3 + 2 + 1 > 5: a new one
        replies = await asyncio.gather(*tasks)
        shapes = [
            (f.version_id, f.key, f.priority, [m.rows for m in f.members])
            for f in wire.infer_frames()
        ]
        # In order, greedily: the fifth request does not fit beside the first (3 + 3 > 5), so
        # the first travels alone (a lone request has no members) and the fifth starts a
        # group the sixth joins; the seventh would pass the batch size and goes alone.
        assert shapes == [
            (1, 1, 1, []),
            (1, 2, 1, []),
            (2, 1, 1, []),
            (1, 1, 2, []),
            (1, 1, 1, [3, 2]),
            (1, 1, 1, []),
        ]
        for i, (header, (y,)) in enumerate(replies[:5]):
            assert isinstance(header, InferResult)
            np.testing.assert_array_equal(y, rows(3, i) * 2)
        np.testing.assert_array_equal(replies[5][1][0], rows(2, 9) * 2)
        np.testing.assert_array_equal(replies[6][1][0], rows(1, 7) * 2)

    asyncio.run(scenario())


def test_an_agent_that_does_not_take_groups_gets_one_frame_per_request() -> None:
    async def scenario() -> None:
        wire = Wire(doubling(1), groups=False)
        replies = await asyncio.gather(*(wire.infer(rows(1, i)) for i in range(3)))
        assert [f.members for f in wire.infer_frames()] == [[], [], []]
        for i, (_, (y,)) in enumerate(replies):
            np.testing.assert_array_equal(y, rows(1, i) * 2)

    asyncio.run(scenario())


def test_a_group_refused_as_a_whole_answers_every_member_with_the_error() -> None:
    async def scenario() -> None:
        wire = Wire(doubling(1))
        wire.serving.loaded = {}  # the version went away on the agent
        replies = await asyncio.gather(*(wire.infer(rows(1, i)) for i in range(2)))
        (frame,) = wire.infer_frames()
        assert len(frame.members) == 2
        assert [(type(h), h.code) for h, _ in replies] == [(InferError, "not_loaded")] * 2
        assert wire.link.in_flight == {} and wire.link.member_of == {}

    asyncio.run(scenario())


def test_rows_that_fail_on_their_own_fail_only_the_members_holding_them() -> None:
    async def scenario() -> None:
        wire = Wire(doubling(1, refuse_negative=True))
        xs = [rows(2, 0), -rows(1, 1) - 1, rows(1, 5)]
        replies = await asyncio.gather(*(wire.infer(x) for x in xs))
        (frame,) = wire.infer_frames()
        assert len(frame.members) == 3
        ok, refused, other = replies
        assert isinstance(refused[0], InferError) and refused[0].code == "bad_input"
        assert "negative" in refused[0].message
        np.testing.assert_array_equal(ok[1][0], xs[0] * 2)
        np.testing.assert_array_equal(other[1][0], xs[2] * 2)
        assert wire.serving.stats.requests_total == 3

    asyncio.run(scenario())


def test_a_group_is_cancelled_only_when_its_last_member_gives_up() -> None:
    async def scenario() -> None:
        wire = Wire(doubling(1))
        wire.hold = True
        first, second = wire.infer(rows(1)), wire.infer(rows(1, 3))
        await asyncio.sleep(0.01)
        (group,) = wire.infer_frames()
        first.cancel()
        await asyncio.sleep(0.01)
        assert not any(isinstance(h, CancelGenerate) for h in wire.seen)  # one still waits
        second.cancel()
        await asyncio.sleep(0.01)
        cancels = [h.id for h in wire.seen if isinstance(h, CancelGenerate)]
        assert cancels == [group.id]
        assert wire.link.pending == {} and wire.link.member_of == {}
        assert wire.link.in_flight == {}

    asyncio.run(scenario())


def test_a_member_that_gives_up_leaves_the_others_their_answers() -> None:
    async def scenario() -> None:
        wire = Wire(doubling(1))
        wire.hold = True
        gone, kept = wire.infer(rows(1)), wire.infer(rows(2, 3))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        wire.release()
        header, (y,) = await kept
        assert isinstance(header, InferResult)
        np.testing.assert_array_equal(y, rows(2, 3) * 2)
        assert wire.link.in_flight == {} and wire.link.member_of == {}

    asyncio.run(scenario())


@pytest.mark.parametrize("groups", [True, False])
def test_a_turn_whose_flusher_leaves_still_sends_the_others_and_the_link_keeps_serving(
    groups: bool,
) -> None:
    """The first request of a turn sends the turn's frames once the turn ends. When its client
    leaves in that very turn, the others' frames must still go, and the next turn must find
    the outbox empty: left full, every later request waited for a flush that never came."""

    async def scenario() -> None:
        wire = Wire(doubling(1), groups=groups)
        flusher, *others = [wire.infer(rows(1, i)) for i in range(3)]
        await asyncio.sleep(0)  # each queued its frame; the first waits for the turn's end
        assert len(wire.link.outbox) == 3
        flusher.cancel()
        async with asyncio.timeout(2):
            replies = await asyncio.gather(*others)
            for i, (header, (y,)) in enumerate(replies, start=1):
                assert isinstance(header, InferResult)
                np.testing.assert_array_equal(y, rows(1, i) * 2)
            later, (y,) = await wire.infer(rows(2, 7))
        assert isinstance(later, InferResult)
        np.testing.assert_array_equal(y, rows(2, 7) * 2)
        assert flusher.cancelled()
        if groups:  # the request whose client left was not sent at all
            assert [len(f.members) for f in wire.infer_frames()] == [2, 0]

    asyncio.run(scenario())


def test_an_agent_answering_a_group_with_other_rows_fails_its_members_with_502() -> None:
    async def scenario() -> None:
        wire = Wire(doubling(1))
        wire.hold = True
        tasks = [wire.infer(rows(1)), wire.infer(rows(1, 2))]
        await asyncio.sleep(0.01)
        (group,) = wire.infer_frames()
        wire.pool.deliver(wire.link, result_frame(group.id, ["y"], [rows(3)]))
        for task in tasks:
            with pytest.raises(DispatchError) as caught:
                await task
            assert caught.value.status == 502

    asyncio.run(scenario())


def test_the_agent_refuses_a_group_whose_members_do_not_add_up_to_its_rows() -> None:
    async def scenario() -> None:
        wire = Wire(doubling(1))
        x = rows(3)
        frame = InferRequest(
            id=77,
            version_id=1,
            inputs=[tensor_of("x", x)],
            members=[Member(1, 1), Member(2, 1)],
        )
        replies: list[bytes] = []

        async def keep(frames: list[bytes]) -> None:
            replies.extend(frames)

        wire.serving.sender = type("S", (), {"send_frames": staticmethod(keep)})()
        wire.serving.handle_frame(encode_frame(frame, [x]))
        await asyncio.sleep(0.01)
        (reply,) = [decode_frame(r)[0] for r in replies]
        assert isinstance(reply, InferError) and (reply.id, reply.code) == (77, "bad_input")

    asyncio.run(scenario())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(1, 3),  # caller (API key)
            st.integers(1, 2),  # version
            st.integers(1, 4),  # rows
            st.booleans(),  # a row of it fails on its own
            st.sampled_from(["answer", "leave"]),  # whether its client waits
        ),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 6),  # the versions' batch size
)
def test_any_turn_of_requests_is_answered_as_each_would_be_alone(
    calls: list[tuple[int, int, int, bool, str]], max_rows: int
) -> None:
    """A property over a turn's requests: whatever callers, versions, sizes and failures, each
    waiting request gets exactly its own rows (or its own refusal), groups never exceed the
    batch size unless a request alone does, and nothing is left behind on either side."""

    async def scenario() -> None:
        loaded = [doubling(1, refuse_negative=True), doubling(2, refuse_negative=True)]
        wire = Wire(*loaded)
        wire.hold = True
        tasks, inputs = [], []
        for i, (key, version, n, fails, _) in enumerate(calls):
            x = rows(n, 10 * i)
            if fails:
                x[-1, 0] = -1.0
            inputs.append(x)
            tasks.append(wire.infer(x, version_id=version, key=key, max_rows=max_rows))
        await asyncio.sleep(0.01)
        for task, (*_, fate) in zip(tasks, calls, strict=True):
            if fate == "leave":
                task.cancel()
        await asyncio.sleep(0.01)
        wire.release()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result, x, (_, _, _, fails, fate) in zip(results, inputs, calls, strict=True):
            if fate == "leave":
                assert isinstance(result, asyncio.CancelledError)
                continue
            header, arrays = result
            if fails:
                assert isinstance(header, InferError) and header.code == "bad_input"
            else:
                assert isinstance(header, InferResult)
                np.testing.assert_array_equal(arrays[0], x * 2)
        for frame in wire.infer_frames():
            if frame.members:
                assert sum(m.rows for m in frame.members) <= max_rows
                assert len({frame.version_id}) == 1
        await asyncio.sleep(0.01)
        assert wire.link.pending == {} and wire.link.member_of == {}
        assert wire.link.in_flight == {}
        for v in loaded:
            assert v.batcher._caller_load == {} and v.batcher.depth == 0
        waiting = sum(1 for *_, fate in calls if fate == "answer")
        assert wire.serving.stats.in_flight == 0
        assert wire.serving.stats.requests_total <= len(calls)
        assert wire.serving.stats.requests_total >= waiting

    asyncio.run(scenario())
