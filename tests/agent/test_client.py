"""The agent's connection loop: small steps alone, then end to end against a fake platform."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort
import pytest

from serving_agent import Agent, ArtifactCache, Batcher, FunctionRuntime
from serving_agent._client import peek_request_id
from serving_agent._versions import Loaded
from serving_agent.protocol import (
    Assign,
    InferError,
    InferRequest,
    InferResult,
    VersionSpec,
    decode_frame,
    encode_frame,
    pack_frames,
    tensor_of,
    unpack_frames,
)
from tests.agent.conftest import running

if TYPE_CHECKING:
    from tests.agent.conftest import FakePlatform, TinyModel

pytestmark = pytest.mark.anyio

TOKEN = "node-token"


class Recorder:
    """A stand-in connection that keeps what the agent sends."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue[str | bytes] = asyncio.Queue()

    async def send(self, message: str | bytes) -> None:
        await self.sent.put(message)

    async def next(self) -> str | bytes:
        async with asyncio.timeout(5):
            return await self.sent.get()

    async def frames(self, count: int) -> list[bytes]:
        """The next ``count`` frames, from however many binary messages carry them."""
        frames: list[bytes] = []
        while len(frames) < count:
            message = await self.next()
            assert isinstance(message, bytes)
            frames.extend(unpack_frames(message))
        return frames


def make_agent(url: str, tmp_path: Path, token: str = TOKEN) -> Agent:
    return Agent(
        url,
        token,
        ArtifactCache(tmp_path / "cache"),
        name="test-node",
        retry_base=0.05,
        retry_cap=0.2,
        auth_retry_s=0.2,
    )


def infer_frame(request_id: int, x: np.ndarray, version_id: int = 1, **kw: object) -> bytes:
    request = InferRequest(id=request_id, version_id=version_id, inputs=[tensor_of("x", x)], **kw)
    return encode_frame(request, [x])


def infer_message(request_id: int, x: np.ndarray, **kw: object) -> bytes:
    """One request as the websocket message the platform sends."""
    return pack_frames([infer_frame(request_id, x, **kw)])


def reference(model: TinyModel, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model.path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def assign(*specs: VersionSpec, heartbeat_s: float = 5.0) -> str:
    return Assign(versions=list(specs), heartbeat_s=heartbeat_s).model_dump_json()


# Small steps -----------------------------------------------------------------------------------


def test_peek_request_id_reads_the_header_of_a_broken_frame() -> None:
    frame = infer_frame(42, np.zeros((1, 4), np.float32))
    assert peek_request_id(frame[:-4]) == 42
    assert peek_request_id(b"\x00\x00") is None
    assert peek_request_id(b"\x00\x00\x00\x02{}") is None


def loaded_agent(tmp_path: Path, spec: VersionSpec) -> tuple[Agent, Recorder]:
    """An agent already serving ``spec`` with a doubling model, talking to a Recorder."""
    runtime = FunctionRuntime(lambda inputs: [inputs["x"][:, :2] * 2], ["x"], ["y"])
    agent = make_agent("http://platform.test", tmp_path)
    agent.versions.loaded[spec.version_id] = Loaded(spec, runtime, Batcher(runtime, inline=True))
    agent.connection.socket = recorder = Recorder()
    return agent, recorder


async def test_a_request_is_answered_with_its_result(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = loaded_agent(tmp_path, make_spec())
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    agent.connection.handle_message(infer_message(5, x))
    (frame,) = await recorder.frames(1)
    header, (y,) = decode_frame(frame)
    assert isinstance(header, InferResult) and header.id == 5
    np.testing.assert_array_equal(y, x[:, :2] * 2)
    heartbeat = agent.heartbeat()
    assert heartbeat.requests_total == 1 and heartbeat.errors_total == 0
    assert heartbeat.p50_ms > 0 and heartbeat.in_flight == 0


async def test_results_report_their_queue_wait_and_run_time_and_batch_sizes(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = loaded_agent(tmp_path, make_spec())
    agent.versions.loaded[1].batcher.batch_sizes = agent.versions.batch_sizes
    agent.connection.handle_message(infer_message(5, np.ones((3, 4), np.float32)))
    header, _ = decode_frame((await recorder.frames(1))[0])
    assert isinstance(header, InferResult)
    assert header.queue_ms >= 0 and header.compute_ms > 0
    heartbeat = agent.heartbeat()
    assert heartbeat.batch_size_counts[2] == 1  # 3 rows: the (2, 4] bucket
    assert heartbeat.batch_rows_total == 3


async def test_a_failed_request_is_logged_with_the_platforms_trace(
    tmp_path: Path, make_spec: Callable[..., VersionSpec], caplog: pytest.LogCaptureFixture
) -> None:
    agent, recorder = loaded_agent(tmp_path, make_spec())
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with caplog.at_level("INFO", logger="serving_agent"):
        agent.connection.handle_message(infer_message(9, np.zeros((1, 3), np.float32), trace=trace))
        await recorder.frames(1)
    assert any(trace in r.getMessage() and "request 9" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (infer_frame(1, np.zeros((1, 4), np.float32), version_id=99), "not_loaded"),
        (infer_frame(1, np.zeros((1, 3), np.float32)), "bad_input"),
        (infer_frame(1, np.zeros((1, 4), np.float64)), "bad_input"),
        (infer_frame(1, np.zeros((1, 4), np.float32), outputs=["nope"]), "bad_input"),
        (infer_frame(1, np.zeros((1, 4), np.float32))[:-1], "bad_input"),  # truncated tensor
    ],
)
async def test_a_request_that_cannot_run_gets_an_error_frame(
    tmp_path: Path, make_spec: Callable[..., VersionSpec], frame: bytes, code: str
) -> None:
    agent, recorder = loaded_agent(tmp_path, make_spec())
    agent.connection.handle_message(pack_frames([frame]))
    header, _ = decode_frame((await recorder.frames(1))[0])
    assert isinstance(header, InferError)
    assert (header.id, header.code) == (1, code)
    assert agent.heartbeat().errors_total == 1


async def test_an_overloaded_version_answers_overloaded(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = loaded_agent(tmp_path, make_spec(max_queue=1))
    agent.versions.loaded[1].batcher.max_queue = 1
    for request_id in (1, 2):
        agent.connection.handle_message(infer_message(request_id, np.zeros((1, 4), np.float32)))
    replies = [decode_frame(frame)[0] for frame in await recorder.frames(2)]
    codes = {r.id: getattr(r, "code", "ok") for r in replies}
    assert codes == {1: "ok", 2: "overloaded"}


async def test_requests_in_one_message_share_a_batch_and_a_reply_message(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = loaded_agent(tmp_path, make_spec())
    xs = [np.full((1, 4), i, np.float32) for i in range(3)]
    agent.connection.handle_message(pack_frames([infer_frame(i, x) for i, x in enumerate(xs)]))
    message = await recorder.next()
    assert isinstance(message, bytes)
    replies = [decode_frame(frame) for frame in unpack_frames(message)]
    assert [header.id for header, _ in replies] == [0, 1, 2]
    for (_, (y,)), x in zip(replies, xs, strict=True):
        np.testing.assert_array_equal(y, x[:, :2] * 2)
    assert agent.versions.loaded[1].batcher.runs == 1


async def test_an_undecodable_frame_is_ignored(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = loaded_agent(tmp_path, make_spec())
    agent.connection.handle_message(b"\xff\xff")  # not even a frame length
    agent.connection.handle_message(pack_frames([b"\x00\x00\x00\x09{}"]))  # no header
    await asyncio.sleep(0.01)
    assert recorder.sent.empty()


async def test_a_new_assign_with_other_limits_keeps_the_loaded_session(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = loaded_agent(tmp_path, make_spec())
    before = agent.versions.loaded[1]
    agent.handle_control(assign(make_spec(max_batch_size=4, max_queue_delay_ms=2)))
    status = json.loads(await recorder.next())
    assert (status["type"], status["state"]) == ("status", "ready")
    assert agent.versions.loaded[1] is before
    assert before.batcher.max_batch_size == 4 and before.batcher.max_queue_delay_ms == 2


# End to end ------------------------------------------------------------------------------------


async def test_hello_carries_the_token_and_node_facts(
    platform: FakePlatform, tmp_path: Path
) -> None:
    async with running(make_agent(platform.url, tmp_path)):
        hello = await platform.expect("hello")
    assert platform.auth_headers == [f"Bearer {TOKEN}"]
    assert hello["host"] == "test-node" and hello["cpu_count"] >= 1
    assert hello["memory_bytes"] > 0 and "CPUExecutionProvider" in hello["providers"]


async def test_an_assigned_version_loads_serves_and_reports_heartbeats(
    platform: FakePlatform,
    tmp_path: Path,
    tiny_model: TinyModel,
    make_spec: Callable[..., VersionSpec],
) -> None:
    async with running(make_agent(platform.url, tmp_path)):
        await platform.expect("hello")
        ws = await platform.next_connection()
        await ws.send(assign(make_spec(), heartbeat_s=0.05))
        await platform.expect("status", state="loading", version_id=1)
        ready = await platform.expect("status", state="ready", version_id=1)
        assert ready["provider"] == "CPUExecutionProvider"

        x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
        await ws.send(infer_message(7, x))
        header, (y,) = decode_frame(await platform.next_frame())
        assert isinstance(header, InferResult) and header.id == 7
        assert header.outputs[0].name == "y"
        np.testing.assert_allclose(y, reference(tiny_model, x), rtol=1e-6)

        heartbeat = await platform.expect("heartbeat", requests_total=1)
        assert heartbeat["errors_total"] == 0 and heartbeat["p50_ms"] > 0
    assert (tmp_path / "cache" / f"{tiny_model.sha256}.onnx").exists()


async def test_a_tampered_artifact_fails_with_sha256_mismatch(
    platform: FakePlatform, tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    platform.artifacts[1] += b"tampered"
    async with running(make_agent(platform.url, tmp_path)):
        ws = await platform.next_connection()
        await ws.send(assign(make_spec()))
        failed = await platform.expect("status", state="failed", version_id=1)
        await ws.send(infer_message(3, np.zeros((1, 4), np.float32)))
        header, _ = decode_frame(await platform.next_frame())
    assert failed["detail"].startswith("sha256 mismatch: expected ")
    assert isinstance(header, InferError) and header.code == "not_loaded"
    assert list((tmp_path / "cache").iterdir()) == []


async def test_after_a_dropped_connection_the_agent_reconnects_and_keeps_its_versions(
    platform: FakePlatform, tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    async with running(make_agent(platform.url, tmp_path)):
        ws = await platform.next_connection()
        await ws.send(assign(make_spec()))
        await platform.expect("status", state="ready", version_id=1)
        await ws.close(1011, "platform restarting")

        await platform.expect("hello")
        ws = await platform.next_connection()
        await ws.send(assign(make_spec()))
        await platform.expect("status", state="ready", version_id=1)
        await ws.send(infer_message(9, np.zeros((1, 4), np.float32)))
        header, _ = decode_frame(await platform.next_frame())
    assert isinstance(header, InferResult)
    assert platform.downloads == [1]
    assert [m["state"] for m in platform.log if m["type"] == "status"] == [
        "loading",
        "ready",
        "ready",
    ]


async def test_unassigned_versions_are_unloaded(
    platform: FakePlatform, tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    async with running(make_agent(platform.url, tmp_path)) as agent:
        ws = await platform.next_connection()
        await ws.send(assign(make_spec()))
        await platform.expect("status", state="ready", version_id=1)
        await ws.send(assign())
        await platform.expect("status", state="unloaded", version_id=1)
        await ws.send(infer_message(4, np.zeros((1, 4), np.float32)))
        header, _ = decode_frame(await platform.next_frame())
        assert agent.versions.loaded == {}
    assert isinstance(header, InferError) and header.code == "not_loaded"


def test_load_avg_is_the_time_requests_spent_over_the_time_that_passed():
    from serving_agent._client import Stats

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
