"""The agent as a whole: its collaborators wired together, then end to end against the fake
platform."""

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
from serving_agent._versions import Loaded
from serving_agent.protocol import (
    Assign,
    InferError,
    InferResult,
    VersionSpec,
    decode_frame,
    pack_frames,
    unpack_frames,
)
from tests.agent.conftest import infer_frame, infer_message, running

if TYPE_CHECKING:
    from tests.agent.conftest import FakePlatform, TinyModel

pytestmark = pytest.mark.anyio

TOKEN = "node-token"


class Recorder:
    """A stand-in for the open websocket that keeps what the agent sends."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue[str | bytes] = asyncio.Queue()

    async def send(self, message: str | bytes) -> None:
        await self.sent.put(message)

    async def next(self) -> str | bytes:
        async with asyncio.timeout(5):
            return await self.sent.get()


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


def reference(model: TinyModel, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model.path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def assign(*specs: VersionSpec, heartbeat_s: float = 5.0) -> str:
    return Assign(versions=list(specs), heartbeat_s=heartbeat_s).model_dump_json()


# Wiring ----------------------------------------------------------------------------------------


def serving_agent(tmp_path: Path, spec: VersionSpec) -> tuple[Agent, Recorder]:
    """An agent already serving ``spec`` with a doubling model, its connection open on a
    Recorder."""
    runtime = FunctionRuntime(lambda inputs: [inputs["x"][:, :2] * 2], ["x"], ["y"])
    agent = make_agent("http://platform.test", tmp_path)
    batcher = Batcher(runtime, inline=True, batch_sizes=agent.versions.batch_sizes)
    agent.versions.loaded[spec.version_id] = Loaded(spec, runtime, batcher)
    agent.connection.socket = recorder = Recorder()
    return agent, recorder


async def test_requests_in_one_message_share_a_batch_and_a_reply_message(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = serving_agent(tmp_path, make_spec())
    xs = [np.full((1, 4), i, np.float32) for i in range(3)]
    agent.connection.handle_message(pack_frames([infer_frame(i, x) for i, x in enumerate(xs)]))
    message = await recorder.next()
    assert isinstance(message, bytes)
    replies = [decode_frame(frame) for frame in unpack_frames(message)]
    assert [header.id for header, _ in replies] == [0, 1, 2]
    for (_, (y,)), x in zip(replies, xs, strict=True):
        np.testing.assert_array_equal(y, x[:, :2] * 2)
    assert agent.versions.loaded[1].batcher.runs == 1


async def test_a_heartbeat_adds_up_serving_and_the_loaded_versions(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = serving_agent(tmp_path, make_spec())
    agent.connection.handle_message(infer_message(5, np.ones((3, 4), np.float32)))
    await recorder.next()
    heartbeat = agent.heartbeat()
    assert (heartbeat.requests_total, heartbeat.errors_total, heartbeat.in_flight) == (1, 0, 0)
    assert heartbeat.p50_ms > 0 and heartbeat.load_avg > 0
    assert heartbeat.batch_size_counts[2] == 1  # 3 rows: the (2, 4] bucket
    assert heartbeat.batch_rows_total == 3
    (load,) = heartbeat.versions
    assert (load.version_id, load.requests_total, load.in_flight) == (1, 1, 0)
    assert heartbeat.memory_used_bytes == agent.versions.memory_used()
    assert heartbeat.evicted == [] and heartbeat.streams_active == 0


async def test_an_assign_goes_to_the_versions_and_its_heartbeat_interval_to_the_connection(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent, recorder = serving_agent(tmp_path, make_spec())
    agent.handle_control(assign(make_spec(max_batch_size=4), heartbeat_s=0.5))
    status = json.loads(await recorder.next())
    assert (status["type"], status["state"], status["version_id"]) == ("status", "ready", 1)
    assert agent.versions.loaded[1].spec.max_batch_size == 4
    assert agent.connection.heartbeat_s == 0.5


@pytest.mark.parametrize(
    ("text", "logged"),
    [
        ('{"type": "rollout"}', "ignoring control message of type 'rollout'"),
        ("not json", "ignoring control message of type None"),
        ('{"type": "assign", "versions": [{"version_id": "x"}]}', "ignoring invalid assign"),
    ],
)
async def test_other_control_messages_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, logged: str
) -> None:
    agent = make_agent("http://platform.test", tmp_path)
    agent.handle_control(text)
    assert logged in caplog.text
    assert agent.connection.heartbeat_s == 5.0 and agent.versions.loaded == {}
    agent.cache.close()


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
