"""Generation on the agent: the engine's continuous batching, sampling, stops, limits and
cancellation; then the agent serving textgen versions over a real websocket."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from serving_agent import Agent, ArtifactCache
from serving_agent._generate import Engine, find_stop, held_back
from serving_agent._versions import LoadedTextGen
from serving_agent.protocol import (
    ARTIFACT_PATH,
    Assign,
    CancelGenerate,
    FrameHeader,
    GenerateDone,
    GenerateRequest,
    GenerationLimits,
    InferError,
    InferRequest,
    TokenBatch,
    TokenChunk,
    VersionSpec,
    decode_frame,
    encode_frame,
    pack_frames,
    tensor_of,
    unbatch,
)
from serving_agent.textgen import TextGenModel, from_safetensors, generate, sample
from tests.agent.conftest import running
from tests.textgen_models import tiny_textgen

if TYPE_CHECKING:
    from tests.agent.conftest import FakePlatform

pytestmark = pytest.mark.anyio

PROMPTS = ["Call me Ishmael.", "Whale", "x", "Some years ago, never mind how long"]


@pytest.fixture(scope="module")
def artifact() -> bytes:
    return tiny_textgen()


@pytest.fixture(scope="module")
def model(artifact: bytes) -> TextGenModel:
    return from_safetensors(artifact, "cpu")


class Collector:
    """Stands in for the agent's connection: keeps each stream's frames, in order."""

    def __init__(self) -> None:
        self.frames: dict[int, list[FrameHeader]] = defaultdict(list)
        self.started: list[int] = []  # request ids in the order of their first frame
        self.sends = 0
        self._ended: dict[int, asyncio.Event] = defaultdict(asyncio.Event)

    async def __call__(self, frames: list[bytes]) -> None:
        self.sends += 1
        for frame in frames:
            for header in unbatch(decode_frame(frame)[0]):
                if header.id not in self.frames:
                    self.started.append(header.id)
                self.frames[header.id].append(header)
                if isinstance(header, GenerateDone | InferError):
                    self._ended[header.id].set()

    async def wait(self, *ids: int, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            for i in ids:
                await self._ended[i].wait()

    def text(self, request_id: int) -> str:
        return "".join(f.text for f in self.frames[request_id] if isinstance(f, TokenChunk))

    def end(self, request_id: int) -> Any:
        return self.frames[request_id][-1]


def request(request_id: int, prompt: str, **fields: Any) -> GenerateRequest:
    fields.setdefault("temperature", 0.0)
    return GenerateRequest(id=request_id, version_id=1, prompt=prompt, **fields)


@pytest.fixture
async def make_engine(model: TextGenModel) -> AsyncIterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(**limits: int) -> Engine:
        engines.append(Engine(model, GenerationLimits(**limits)))
        return engines[-1]

    yield make
    for engine in engines:
        await engine.stop()


async def alone(model: TextGenModel, req: GenerateRequest) -> tuple[str, GenerateDone]:
    """The text and the done frame a request gets with the engine to itself."""
    engine, out = Engine(model), Collector()
    engine.submit(req, out)
    await out.wait(req.id)
    await engine.stop()
    assert engine.stats.max_decode_batch == 1
    return out.text(req.id), out.end(req.id)


async def until(condition: Callable[[], bool], timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.0005)


# Small steps ----------------------------------------------------------------------------------


def test_find_stop_finds_the_earliest_stop_near_the_new_text() -> None:
    assert find_stop("the whale spouted", ["whale", "the"], 0) == 0
    # Only stops that end in the new text (from ``start`` on) can be new: 'whale' ended before.
    assert find_stop("the whale spouted", ["whale", "spout"], 12) == 10
    assert find_stop("the whale", ["whale"], 8) == 4
    assert find_stop("the whale", ["ship"], 0) is None


def test_held_back_keeps_what_could_begin_a_stop_string() -> None:
    assert held_back("Call me Ish", ["Ishmael"]) == 3
    assert held_back("Call me I", ["Ishmael", "I!"]) == 1
    assert held_back("Call me", ["Ishmael"]) == 0
    assert held_back("anything", []) == 0


def test_sampling_is_greedy_at_temperature_zero_and_a_tiny_top_p() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    generator = torch.Generator().manual_seed(0)
    assert sample(logits, 0.0, 1.0, generator) == 1
    assert all(sample(logits, 1.0, 1e-6, generator) == 1 for _ in range(20))
    picks = {sample(logits, 1.0, 0.9, generator) for _ in range(200)}
    assert picks == {1, 2}  # the nucleus holding 90 % leaves out the two unlikely tokens


# The engine ------------------------------------------------------------------------------------


async def test_a_stream_sends_chunks_then_done(model: TextGenModel) -> None:
    text, done = await alone(model, request(1, "Call me", max_new_tokens=20))
    assert text == generate(model, "Call me", 20)  # the engine decodes as the reference does
    assert (done.finish_reason, done.input_tokens, done.output_tokens) == ("length", 7, 20)
    assert done.ttft_ms > 0 and done.decode_ms > 0


async def test_streams_in_a_shared_batch_get_exactly_the_text_they_get_alone(
    model: TextGenModel, make_engine: Callable[..., Engine]
) -> None:
    # Different prompt lengths, joining at different steps, leaving at different steps (a
    # stream leaving mid-batch moves the last row into its hole), and a fifth joining later.
    lengths = [40, 12, 30, 20, 15]
    prompts = [*PROMPTS, "It is a way I have"]
    reqs = [
        request(i, p, max_new_tokens=n)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    expected = [await alone(model, r) for r in reqs]

    engine, out = make_engine(max_streams=4), Collector()
    for req, join_at in zip(reqs[:4], [0, 3, 6, 9], strict=True):
        await until(lambda n=join_at: engine.stats.decode_steps_total >= n)
        engine.submit(req, out)
    await out.wait(1)  # the shortest has left: a row is free
    engine.submit(reqs[4], out)
    await out.wait(*range(5))

    for i, (text, done) in enumerate(expected):
        assert out.text(i) == text, f"stream {i}"
        assert out.end(i).output_tokens == done.output_tokens == lengths[i]
    assert engine.stats.max_decode_batch == 4
    assert engine.stats.tokens_generated_total == sum(lengths)
    assert engine.stats.decode_steps_total < sum(lengths)  # steps were shared
    assert engine.streams_active == 0 and engine._active == []


async def test_the_cache_grows_with_the_streams_and_keeps_what_it_holds(
    model: TextGenModel, make_engine: Callable[..., Engine]
) -> None:
    reqs = [request(i, f"{i} Call me", max_new_tokens=20) for i in range(6)]
    expected = [(await alone(model, r))[0] for r in reqs]
    engine, out = make_engine(max_streams=6), Collector()
    assert engine.cache.rows == 4  # rows are allocated as streams come, not all up front
    for i, req in enumerate(reqs):
        await until(lambda n=i: engine.stats.decode_steps_total >= n)
        engine.submit(req, out)
    await out.wait(*range(6))
    assert [out.text(i) for i in range(6)] == expected
    assert engine.cache.rows == 6 and engine.stats.max_decode_batch == 6


async def test_a_new_stream_joins_the_running_batch_at_the_next_step(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(), Collector()
    engine.submit(request(1, "Call me", max_new_tokens=40), out)
    await until(lambda: engine.stats.decode_steps_total >= 5)
    engine.submit(request(2, "Whale", max_new_tokens=5), out)
    await out.wait(2)
    assert engine.stats.max_decode_batch == 2
    assert not out._ended[1].is_set()  # the long stream kept going while the short one ran
    await out.wait(1)


async def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(
    model: TextGenModel, make_engine: Callable[..., Engine]
) -> None:
    def sampled(request_id: int, seed: int) -> GenerateRequest:
        return request(
            request_id, "Call me", max_new_tokens=30, temperature=0.9, top_p=0.95, seed=seed
        )

    first, _ = await alone(model, sampled(1, seed=7))
    again, _ = await alone(model, sampled(1, seed=7))
    other, _ = await alone(model, sampled(1, seed=8))
    assert first == again and first != other

    engine, out = make_engine(), Collector()
    engine.submit(sampled(1, seed=7), out)
    engine.submit(request(2, "Whale", max_new_tokens=30), out)
    engine.submit(sampled(3, seed=8), out)
    await out.wait(1, 2, 3)
    assert (out.text(1), out.text(3)) == (first, other)
    assert engine.stats.max_decode_batch == 3


async def test_a_stop_string_ends_the_stream_and_is_never_sent(model: TextGenModel) -> None:
    full, _ = await alone(model, request(1, "Call me", max_new_tokens=30))
    stop = full[12:15]  # three characters: they arrive over several steps
    expected = full[: full.index(stop)]
    text, done = await alone(model, request(1, "Call me", max_new_tokens=30, stop=["zzz", stop]))
    assert text == expected
    assert done.finish_reason == "stop"
    assert done.output_tokens < 30

    text, done = await alone(model, request(1, "Call me", max_new_tokens=30, stop=["\x00zz"]))
    assert (text, done.finish_reason) == (full, "length")  # held-back text is sent at the end


async def test_the_end_of_the_context_ends_a_stream_with_length(model: TextGenModel) -> None:
    prompt = "a" * 60  # the tiny model has 64 positions
    text, done = await alone(model, request(1, prompt, max_new_tokens=50))
    assert (done.finish_reason, done.output_tokens) == ("length", 64 - 60 + 1)
    assert text == generate(model, prompt, 50)


async def test_cancel_stops_decoding_within_a_few_steps(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(), Collector()
    engine.submit(request(1, "Call me", max_new_tokens=56), out)
    await until(lambda: engine.stats.tokens_generated_total >= 3)
    steps_at_cancel = engine.stats.decode_steps_total
    engine.cancel(1)
    await out.wait(1)
    done = out.end(1)
    assert isinstance(done, GenerateDone) and done.finish_reason == "cancelled"
    assert engine.stats.decode_steps_total - steps_at_cancel <= 2
    assert done.output_tokens <= steps_at_cancel + 2 < 56
    assert engine.stats.streams_cancelled_total == 1
    await asyncio.sleep(0.02)
    assert engine.stats.decode_steps_total - steps_at_cancel <= 2  # nothing decodes any more
    assert engine.streams_active == 0 and engine._active == []
    engine.cancel(1)  # a cancel for a finished stream is ignored
    assert engine.stats.streams_cancelled_total == 1


async def test_cancel_all_frees_every_row(make_engine: Callable[..., Engine]) -> None:
    engine, out = make_engine(max_streams=3), Collector()
    for i in range(3):
        engine.submit(request(i, PROMPTS[i], max_new_tokens=56), out)
    await until(lambda: engine.stats.decode_steps_total >= 2)
    engine.cancel_all()
    assert engine.streams_active == 0  # the ids are free at once
    await out.wait(0, 1, 2)
    assert {out.end(i).finish_reason for i in range(3)} == {"cancelled"}
    assert engine.stats.streams_cancelled_total == 3 and engine._active == []


async def test_cancel_all_of_one_connection_leaves_the_others_streams(
    make_engine: Callable[..., Engine],
) -> None:
    engine, ours, theirs = make_engine(max_streams=3), Collector(), Collector()
    engine.submit(request(0, PROMPTS[0], max_new_tokens=56), ours)
    engine.submit(request(1, PROMPTS[1], max_new_tokens=8), theirs)
    await until(lambda: engine.stats.decode_steps_total >= 2)
    engine.cancel_all({ours})
    assert engine.streams_active == 1
    await ours.wait(0)
    await theirs.wait(1)
    assert ours.end(0).finish_reason == "cancelled"
    assert theirs.end(1).finish_reason != "cancelled"


async def test_requests_past_the_limits_are_refused(make_engine: Callable[..., Engine]) -> None:
    engine, out = make_engine(max_input_tokens=10, max_output_tokens=20, max_streams=2), Collector()
    with pytest.raises(ValueError, match="prompt is 11 tokens; this version takes at most 10") as e:
        engine.submit(request(1, "Call me Ish"), out)
    assert e.value.code == "bad_input"
    with pytest.raises(ValueError, match="max_new_tokens is 21") as e:
        engine.submit(request(1, "Call", max_new_tokens=21), out)
    assert e.value.code == "bad_input"

    for i in range(1, 5):  # two generate, two wait for a slot
        engine.submit(request(i, "Call", max_new_tokens=20), out)
    with pytest.raises(Exception, match="2 streams already generating and 2 waiting") as e:
        engine.submit(request(5, "Ishmael", max_new_tokens=20), out)
    assert e.value.code == "overloaded"
    assert engine.counts.shed == 1
    await out.wait(1, 2, 3, 4)
    engine.submit(request(5, "Ishmael", max_new_tokens=20), out)  # room again
    await out.wait(5)


async def test_the_model_context_caps_the_prompt_below_a_larger_limit(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(max_input_tokens=512)
    with pytest.raises(ValueError, match="prompt is 65 tokens; this version takes at most 64"):
        engine.submit(request(1, "a" * 65), Collector())


async def test_stopping_the_engine_fails_live_streams_with_not_loaded(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(), Collector()
    engine.submit(request(1, "Call me", max_new_tokens=56), out)
    await until(lambda: engine.stats.decode_steps_total >= 1)
    await engine.stop()
    end = out.end(1)
    assert isinstance(end, InferError) and end.code == "not_loaded"
    with pytest.raises(Exception, match="unloaded") as e:
        engine.submit(request(2, "Call me"), out)
    assert e.value.code == "not_loaded"


async def test_a_failing_step_fails_its_streams_and_the_engine_goes_on(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, out = make_engine(), Collector()
    with monkeypatch.context() as patch:
        patch.setattr(Engine, "_decode", lambda self, out: 1 / 0)
        engine.submit(request(1, "Call me", max_new_tokens=5), out)
        await out.wait(1)
    error = out.end(1)
    assert isinstance(error, InferError) and error.code == "internal"
    assert engine.streams_active == 0
    engine.submit(request(2, "Call me", max_new_tokens=5), out)
    await out.wait(2)
    assert out.end(2).output_tokens == 5


async def test_a_step_sends_all_its_frames_in_one_call(make_engine: Callable[..., Engine]) -> None:
    engine, out = make_engine(), Collector()
    for i in range(3):
        engine.submit(request(i, PROMPTS[i], max_new_tokens=8), out)
    await out.wait(0, 1, 2)
    assert out.sends <= engine.stats.decode_steps_total


async def test_a_step_sends_one_batch_of_every_streams_text_then_the_done_frames(
    model: TextGenModel, make_engine: Callable[..., Engine]
) -> None:
    sends: list[list[FrameHeader]] = []

    async def record(frames: list[bytes]) -> None:
        sends.append([decode_frame(frame)[0] for frame in frames])

    lengths = [8, 5, 12]
    reqs = [request(i, PROMPTS[i], max_new_tokens=n) for i, n in enumerate(lengths)]
    engine = make_engine()
    for req in reqs:
        engine.submit(req, record)
    await until(lambda: sum(isinstance(f, GenerateDone) for s in sends for f in s) == 3)

    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, int] = defaultdict(int)
    for frames in sends:
        # At most one batch a step, first; then only done frames.
        first, *rest = frames
        assert all(isinstance(f, GenerateDone) for f in rest)
        if isinstance(first, TokenBatch):
            assert len({c.id for c in first.chunks}) == len(first.chunks)
            for chunk in first.chunks:
                texts[chunk.id] += chunk.text
                tokens[chunk.id] += chunk.tokens
    assert max(len(f[0].chunks) for f in sends if isinstance(f[0], TokenBatch)) == 3
    for req, n in zip(reqs, lengths, strict=True):
        text, done = await alone(model, req)
        assert (texts[req.id], tokens[req.id]) == (text, n) and done.output_tokens == n


# The agent ------------------------------------------------------------------------------------

TOKEN = "node-token"


def textgen_spec(artifact: bytes, version_id: int = 2, **limits: int) -> VersionSpec:
    return VersionSpec(
        version_id=version_id,
        model="writer",
        version=1,
        sha256=hashlib.sha256(artifact).hexdigest(),
        artifact_url=ARTIFACT_PATH.format(version_id=version_id),
        format="textgen",
        inputs=[],
        outputs=[],
        device="cpu",
        generation=GenerationLimits(**{"max_output_tokens": 56, "max_streams": 4, **limits}),
    )


def generate_message(request_id: int, prompt: str, version_id: int = 2, **fields: Any) -> bytes:
    fields.setdefault("temperature", 0.0)
    req = GenerateRequest(id=request_id, version_id=version_id, prompt=prompt, **fields)
    return pack_frames([encode_frame(req)])


class AgentRun:
    """An agent connected to the fake platform, with the textgen version loaded."""

    def __init__(self, agent: Agent, platform: FakePlatform, ws: Any) -> None:
        self.agent, self.platform, self.ws = agent, platform, ws

    async def stream(self, request_id: int, timeout: float = 10) -> list[FrameHeader]:
        """The frames of one stream up to its end (other streams' frames are dropped)."""
        frames: list[FrameHeader] = []
        async with asyncio.timeout(timeout):
            while True:
                for header in unbatch(decode_frame(await self.platform.frames.get())[0]):
                    if header.id == request_id:
                        frames.append(header)
                        if isinstance(header, GenerateDone | InferError):
                            return frames


@pytest.fixture
async def served(
    platform: FakePlatform, tmp_path: Path, artifact: bytes
) -> AsyncIterator[AgentRun]:
    platform.artifacts[2] = artifact
    agent = Agent(platform.url, TOKEN, ArtifactCache(tmp_path / "cache"), name="test-node")
    async with running(agent, timeout=10):
        ws = await platform.next_connection()
        assign = Assign(versions=[textgen_spec(artifact)], heartbeat_s=0.05)
        await ws.send(assign.model_dump_json())
        ready = await platform.expect("status", state="ready", version_id=2, timeout=20)
        assert ready["provider"] == "torch-cpu"
        yield AgentRun(agent, platform, ws)


def slow_steps(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.005) -> None:
    """Make every decode step take a while, so a stream is surely still running."""
    decode = Engine._decode

    def slow(self: Engine, out: list) -> None:
        time.sleep(seconds)
        decode(self, out)

    monkeypatch.setattr(Engine, "_decode", slow)


async def test_a_generate_frame_gets_token_chunks_then_done(
    served: AgentRun, model: TextGenModel
) -> None:
    await served.ws.send(generate_message(7, "Call me", max_new_tokens=24))
    frames = await served.stream(7)
    chunks, done = frames[:-1], frames[-1]
    assert chunks and all(isinstance(c, TokenChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == generate(model, "Call me", 24)
    assert isinstance(done, GenerateDone)
    assert (done.finish_reason, done.input_tokens, done.output_tokens) == ("length", 7, 24)
    heartbeat = await served.platform.expect("heartbeat", tokens_generated_total=24)
    assert heartbeat["decode_steps_total"] == 24 and heartbeat["max_decode_batch"] == 1
    assert heartbeat["streams_active"] == 0


async def test_concurrent_streams_share_decode_steps_on_the_agent(served: AgentRun) -> None:
    messages = [generate_message(i, p, max_new_tokens=30) for i, p in enumerate(PROMPTS)]
    await served.ws.send(b"".join(messages))  # one websocket message, four frames
    ended: dict[int, FrameHeader] = {}
    async with asyncio.timeout(10):
        while len(ended) < 4:
            header, _ = decode_frame(await served.platform.frames.get())
            if isinstance(header, GenerateDone):
                ended[header.id] = header
    assert {d.output_tokens for d in ended.values()} == {30}
    heartbeat = await served.platform.expect("heartbeat", tokens_generated_total=120)
    assert heartbeat["max_decode_batch"] == 4 and heartbeat["decode_steps_total"] < 120


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (generate_message(3, "Call me", version_id=99), "not_loaded"),
        (generate_message(3, "a" * 65), "bad_input"),
        (generate_message(3, "Call me", max_new_tokens=57), "bad_input"),
        (
            pack_frames(
                [
                    encode_frame(
                        InferRequest(
                            id=3, version_id=2, inputs=[tensor_of("x", np.zeros(1, np.float32))]
                        ),
                        [np.zeros(1, np.float32)],
                    )
                ]
            ),
            "bad_input",
        ),
    ],
)
async def test_a_stream_that_cannot_start_gets_an_error_frame(
    served: AgentRun, message: bytes, code: str
) -> None:
    await served.ws.send(message)
    (error,) = await served.stream(3)
    assert isinstance(error, InferError) and error.code == code


async def test_a_cancel_frame_stops_the_stream(
    served: AgentRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_steps(monkeypatch)
    await served.ws.send(generate_message(5, "Call me", max_new_tokens=56))
    header, _ = decode_frame(await served.platform.next_frame())
    assert isinstance(header, TokenBatch) and header.chunks[0].id == 5
    await served.ws.send(pack_frames([encode_frame(CancelGenerate(id=5))]))
    done = (await served.stream(5))[-1]
    assert isinstance(done, GenerateDone) and done.finish_reason == "cancelled"
    assert done.output_tokens < 56
    await served.platform.expect("heartbeat", streams_cancelled_total=1, streams_active=0)


async def test_a_dropped_connection_cancels_every_stream(
    served: AgentRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_steps(monkeypatch)
    await served.ws.send(
        b"".join(generate_message(i, "Call me", max_new_tokens=56) for i in (1, 2))
    )
    await served.platform.next_frame()
    await served.ws.close(1011, "gateway restarting")

    await served.platform.next_connection()
    heartbeat = await served.platform.expect("heartbeat", streams_cancelled_total=2, timeout=5)
    assert heartbeat["streams_active"] == 0
    assert served.agent.versions.engines()[0]._active == []  # their cache rows are free


async def test_unloading_a_version_fails_its_streams_and_keeps_the_totals(
    served: AgentRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    await served.ws.send(generate_message(1, "Call me", max_new_tokens=10))
    await served.stream(1)
    slow_steps(monkeypatch)
    await served.ws.send(generate_message(2, "Call me", max_new_tokens=56))
    await served.platform.next_frame()
    await served.ws.send(Assign(versions=[], heartbeat_s=0.05).model_dump_json())
    (*_, end) = await served.stream(2)
    assert isinstance(end, InferError) and end.code == "not_loaded"
    await served.platform.expect("status", state="unloaded", version_id=2)
    assert served.agent.versions.loaded == {}
    while not served.platform.messages.empty():  # heartbeats sent before the unload
        served.platform.messages.get_nowait()
    heartbeat = await served.platform.expect("heartbeat")
    assert heartbeat["tokens_generated_total"] >= 11 and heartbeat["max_decode_batch"] == 1


async def test_new_limits_apply_without_a_reload(served: AgentRun, artifact: bytes) -> None:
    before = served.agent.versions.loaded[2]
    spec = textgen_spec(artifact, max_streams=8, max_output_tokens=8)
    await served.ws.send(Assign(versions=[spec], heartbeat_s=0.05).model_dump_json())
    await served.platform.expect("status", state="ready", version_id=2)
    loaded = served.agent.versions.loaded[2]
    assert loaded is before and isinstance(loaded, LoadedTextGen)
    assert loaded.engine.limits.max_streams == 8
    await served.ws.send(generate_message(4, "Call me", max_new_tokens=9))
    (error,) = await served.stream(4)
    assert isinstance(error, InferError) and error.code == "bad_input"


# Admission: priority classes and deadlines ------------------------------------------------------


async def test_waiting_streams_are_admitted_best_class_first_fifo_within_a_class(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(max_streams=1, max_waiting=8), Collector()
    engine.submit(request(0, "Call me", max_new_tokens=12), out)  # holds the only slot
    await until(lambda: engine.stats.decode_steps_total >= 1)
    # critical 0, interactive 1, batch 2, shadow 3
    for request_id, priority in [(1, 2), (2, 1), (3, 3), (4, 0), (5, 1), (6, 0), (7, 2)]:
        engine.submit(request(request_id, "Whale", max_new_tokens=2, priority=priority), out)
    await out.wait(*range(8))
    assert out.started == [0, 4, 6, 2, 5, 1, 7, 3]
    assert {out.end(i).finish_reason for i in range(8)} == {"length"}


async def test_a_stream_still_waiting_past_its_budget_is_dropped_unrun(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(max_streams=1, max_waiting=2), Collector()
    engine.submit(request(0, "Call me", max_new_tokens=40), out)
    await until(lambda: engine.stats.decode_steps_total >= 1)
    engine.submit(request(1, "Whale", max_new_tokens=4, budget_ms=1.0), out)  # gone by its turn
    engine.submit(request(2, "Whale", max_new_tokens=4, budget_ms=60_000.0), out)
    await out.wait(1)
    error = out.end(1)
    assert isinstance(error, InferError) and error.code == "expired"
    assert "past its budget of 1 ms" in error.message
    assert out.frames[1] == [error]  # no token: never computed
    assert engine.counts.expired == 1
    assert not out._ended[0].is_set()  # dropped while the slot was still taken
    await out.wait(0, 2)
    assert out.end(2).finish_reason == "length"  # a budget long enough is admitted
    assert engine.stats.tokens_generated_total == 40 + 4


async def test_a_full_waiting_room_evicts_a_worse_class_for_a_better_one(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(max_streams=1, max_waiting=1), Collector()
    engine.submit(request(0, "Call me", max_new_tokens=20), out)
    await until(lambda: engine.stats.decode_steps_total >= 1)
    engine.submit(request(1, "Whale", max_new_tokens=2, priority=2), out)  # batch, waits
    with pytest.raises(Exception, match="1 streams already generating") as e:
        engine.submit(request(2, "Whale", max_new_tokens=2, priority=2), out)  # no worse
    assert e.value.code == "overloaded"
    engine.submit(request(3, "Whale", max_new_tokens=2, priority=0), out)  # critical: evicts
    await out.wait(0, 1, 3)
    evicted = out.end(1)
    assert isinstance(evicted, InferError) and evicted.code == "overloaded"
    assert "for a 'critical' stream" in evicted.message
    assert out.end(3).finish_reason == "length"
    assert engine.counts.shed == 2


async def test_a_waiting_stream_cancelled_is_counted_and_never_run(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(max_streams=1), Collector()
    engine.submit(request(0, "Call me", max_new_tokens=20), out)
    await until(lambda: engine.stats.decode_steps_total >= 1)
    engine.submit(request(1, "Whale", max_new_tokens=4), out)
    engine.cancel(1)
    await out.wait(0, 1)
    assert out.end(1).finish_reason == "cancelled" and out.end(1).output_tokens == 0
    assert engine.counts.cancelled == 1


async def test_each_step_is_a_metered_run_whose_rows_are_its_streams(
    make_engine: Callable[..., Engine],
) -> None:
    engine, out = make_engine(), Collector()
    engine.submit(request(1, "Call me", max_new_tokens=6), out)
    engine.submit(request(2, "Ishmael", max_new_tokens=6), out)
    await out.wait(1, 2)
    totals = engine.totals
    # Both streams decode together: about one run per token, most of them two rows wide.
    assert 6 <= totals.runs <= 14 and totals.rows > totals.runs
    assert totals.cpu_s > 0 and totals.run_s > 0 and totals.accel_s == 0.0
    assert totals.queue_wait_s >= 0.0
