"""Python packages that stream text (format ``python_generator``): the worker harness's loop of
generators (``switchyard_client.model.serve_streams``) over a socket pair, then the agent's
``PythonEngine`` with a real sandboxed worker running tests/packages/word_echo: text, usage and
frames as the built-in engine sends them, stops, lengths and cancels enforced by the agent, a
generator that raises, one that hangs (its worker killed, the next stream served by a new one),
concurrent streams sharing rounds, the stream limit, and what the worker may not send."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from serving_agent import _python
from serving_agent._exceptions import BadInput, Overloaded
from serving_agent._python_engine import PythonEngine, load_python_engine
from serving_agent.protocol import (
    FrameHeader,
    GenerateDone,
    GenerateRequest,
    GenerationLimits,
    InferError,
    TensorSpec,
    TokenBatch,
    TokenChunk,
    VersionSpec,
    decode_frame,
    unbatch,
)
from switchyard_client.model import InvalidInput, pack, serve_streams, unpack
from tests.python_packages import PACKAGES

pytestmark = pytest.mark.anyio


# The harness's loop, over a socket pair ------------------------------------------------------


class Model:
    """Stands in for a loaded package (``Handler``): its ``generate`` by prompt."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    def generate(self, prompt: str, parameters: dict[str, Any]) -> Iterator[str]:
        return self._run(prompt, parameters)

    def _run(self, prompt: str, parameters: dict[str, Any]) -> Iterator[str]:
        try:
            if prompt == "forever":
                n = 0
                while True:
                    n += 1
                    yield f"{n} "
            elif prompt == "raise":
                yield "one "
                raise ValueError("asked to fail")
            elif prompt == "invalid":
                raise InvalidInput("no")
            elif prompt == "bytes":
                yield b"x"  # type: ignore[misc]
            else:
                yield from prompt.split()
        finally:
            self.closed.append(prompt)


class Agent:
    """The agent's end of the socket: sends messages, reads steps."""

    def __init__(self, model: Model) -> None:
        self.sock, theirs = socket.socketpair()
        self.thread = threading.Thread(target=serve_streams, args=(theirs, model), daemon=True)
        self.thread.start()
        self.sock.settimeout(10)

    def send(self, **header: Any) -> None:
        self.sock.sendall(pack(header))

    def step(self) -> list[dict[str, Any]]:
        length = int.from_bytes(self._read(4), "big")
        header, _ = unpack(self._read(length))
        assert header["op"] == "step"
        return header["events"]

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "the worker closed its end"
            data += chunk
        return data


def test_every_live_generator_advances_once_per_round_and_ends_or_fails_alone() -> None:
    agent = Agent(Model())
    prompts = {1: "a b c", 2: "raise", 3: "invalid", 4: "bytes"}
    # In one write: the four start in one round.
    agent.sock.sendall(
        b"".join(
            pack({"op": "generate", "id": i, "prompt": p, "parameters": {}})
            for i, p in prompts.items()
        )
    )
    rounds = [agent.step() for _ in range(4)]
    assert rounds[0] == [{"id": 1, "text": "a"}, {"id": 2, "text": "one "}, *rounds[0][2:]]
    errors = {e["id"]: e for e in rounds[0][2:]}
    assert errors[3]["code"] == "bad_input" and "InvalidInput: no" in errors[3]["error"]
    assert errors[4]["code"] == "internal" and "yielded bytes, not str" in errors[4]["error"]
    assert rounds[1][0] == {"id": 1, "text": "b"}
    assert rounds[1][1]["id"] == 2 and "ValueError: asked to fail" in rounds[1][1]["error"]
    assert "(at test_python_engine.py:" in rounds[1][1]["error"]  # where the code raised
    assert rounds[2] == [{"id": 1, "text": "c"}]
    assert rounds[3] == [{"id": 1, "end": True}]
    agent.sock.close()
    agent.thread.join(5)
    assert not agent.thread.is_alive()


def test_new_streams_and_cancels_are_read_between_rounds_without_waiting() -> None:
    model = Model()
    agent = Agent(model)
    agent.send(op="generate", id=1, prompt="forever", parameters={})
    assert agent.step() == [{"id": 1, "text": "1 "}]
    agent.send(op="generate", id=2, prompt="x y", parameters={})
    # Stream 1 never waits for a message: it keeps going until stream 2 joins a round.
    while len(events := agent.step()) == 1:
        assert events[0]["id"] == 1
    assert [e["id"] for e in events] == [1, 2] and events[1]["text"] == "x"
    agent.send(op="cancel", id=1)
    agent.send(op="cancel", id=99)  # not live there: acknowledged all the same
    seen: list[dict[str, Any]] = []
    while {"id": 99, "cancelled": True} not in seen:
        seen += agent.step()
    assert {"id": 1, "cancelled": True} in seen
    assert "forever" in model.closed  # the cancelled generator was closed (its finally ran)
    agent.sock.close()
    agent.thread.join(5)
    assert not agent.thread.is_alive()


def test_the_agent_closing_its_end_closes_every_live_generator() -> None:
    model = Model()
    agent = Agent(model)
    agent.send(op="generate", id=1, prompt="forever", parameters={})
    agent.step()
    agent.sock.close()
    agent.thread.join(5)
    assert not agent.thread.is_alive() and model.closed == ["forever"]


# The engine, with a real sandboxed worker -----------------------------------------------------


class Collector:
    """Stands in for the agent's connection: each stream's frames, in order."""

    def __init__(self) -> None:
        self.frames: dict[int, list[FrameHeader]] = defaultdict(list)
        self.batches = 0
        self._ended: dict[int, asyncio.Event] = defaultdict(asyncio.Event)

    async def __call__(self, frames: list[bytes]) -> None:
        for frame in frames:
            header = decode_frame(frame)[0]
            self.batches += isinstance(header, TokenBatch)
            for item in unbatch(header):
                self.frames[item.id].append(item)
                if isinstance(item, GenerateDone | InferError):
                    self._ended[item.id].set()

    async def wait(self, *ids: int, timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            for i in ids:
                await self._ended[i].wait()

    def chunks(self, request_id: int) -> list[TokenChunk]:
        return [f for f in self.frames[request_id] if isinstance(f, TokenChunk)]

    def text(self, request_id: int) -> str:
        return "".join(c.text for c in self.chunks(request_id))

    def end(self, request_id: int) -> Any:
        return self.frames[request_id][-1]


LONG = 1_000_000  # items: a "count" stream that runs until it is stopped


def request(request_id: int, prompt: str, **fields: Any) -> GenerateRequest:
    return GenerateRequest(id=request_id, version_id=1, prompt=prompt, **fields)


async def until(condition: Callable[[], bool], timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("the sandbox needs root and bubblewrap")
    root = tmp_path_factory.mktemp("sandbox")
    before = os.environ.get("SWITCHYARD_SANDBOX_DIR")
    os.environ["SWITCHYARD_SANDBOX_DIR"] = str(root)
    yield root
    if before is None:
        del os.environ["SWITCHYARD_SANDBOX_DIR"]
    else:
        os.environ["SWITCHYARD_SANDBOX_DIR"] = before


def spec_of(folder: Path, **limits: int) -> VersionSpec:
    digest = hashlib.sha256(str(folder).encode()).hexdigest()
    text = [TensorSpec(name="text", datatype="BYTES", shape=[-1])]
    return VersionSpec(
        version_id=1,
        model="echo",
        version=1,
        sha256=digest,
        artifact_url="",
        format="python_generator",
        inputs=[TensorSpec(name="prompt", datatype="BYTES", shape=[-1])],
        outputs=text,
        generation=GenerationLimits(**limits),
        tenant_id=7,
    )


@pytest.fixture
async def make_engine(sandbox: Path, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    engines: list[PythonEngine] = []

    async def make(timeout_s: float | None = None, **limits: int) -> PythonEngine:
        folder = tmp_path / f"word_echo{len(engines)}"
        shutil.copytree(PACKAGES / "word_echo", folder)
        if timeout_s is not None:
            manifest = folder / "switchyard.toml"
            text = manifest.read_text().replace("timeout_s = 2", f"timeout_s = {timeout_s}")
            manifest.write_text(text)
        spec = spec_of(folder, **limits)

        async def progress(detail: str) -> None:
            pass

        await _python.prepare_python(folder, spec, progress)
        engine, _ = await asyncio.to_thread(load_python_engine, folder, spec)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


async def test_a_stream_gets_its_text_in_token_batches_then_its_usage(make_engine) -> None:
    engine, out = await make_engine(), Collector()
    engine.submit(request(1, "the whale spouted twice"), out)
    await out.wait(1)
    assert out.text(1) == "the whale spouted twice"
    assert [c.tokens for c in out.chunks(1)] == [1, 1, 1, 1]  # one token per yielded string
    done = out.end(1)
    assert isinstance(done, GenerateDone) and done.finish_reason == "stop"
    assert done.input_tokens == len(b"the whale spouted twice") and done.output_tokens == 4
    assert 0 < done.ttft_ms and done.decode_ms >= 0
    assert out.batches >= 4 and engine.streams_active == 0
    assert engine.stats.tokens_generated_total == 4
    assert engine.provider == "python (sandboxed)"
    # The parameters reach the code as the request gave them.
    engine.submit(request(2, "params", max_new_tokens=9, temperature=0.5, seed=3), out)
    await out.wait(2)
    assert json.loads(out.text(2)) == {
        "max_new_tokens": 9,
        "seed": 3,
        "stop": [],
        "temperature": 0.5,
        "top_k": 0,
        "top_p": 1.0,
    }


async def test_max_new_tokens_stop_strings_and_cancel_are_the_agents(make_engine) -> None:
    engine, out = await make_engine(max_output_tokens=LONG), Collector()
    engine.submit(request(1, "count", max_new_tokens=7), out)
    engine.submit(request(2, "count", max_new_tokens=50, stop=[" 5", "nothing"]), out)
    engine.submit(request(3, "count", max_new_tokens=LONG), out)
    await out.wait(1, 2)
    assert out.text(1) == "1 2 3 4 5 6 7"
    assert out.end(1).finish_reason == "length" and out.end(1).output_tokens == 7
    assert out.text(2) == "1 2 3 4" and out.end(2).finish_reason == "stop"
    assert out.end(2).output_tokens == 5  # the item that held the stop string counted
    # Text that could begin a stop string is held back until it cannot: " 5" never went out.
    assert all(not c.text.endswith(" ") for c in out.chunks(2))
    await until(lambda: len(out.chunks(3)) >= 3)
    engine.cancel(3)
    await out.wait(3)
    assert out.end(3).finish_reason == "cancelled"
    assert engine.stats.streams_cancelled_total == 1 and engine.streams_active == 0
    # The worker heard of each stream ended here and closed its generator.
    worker = engine._worker
    assert worker is not None
    await until(lambda: not worker.gone and not worker.streams)
    assert engine.stats.max_decode_batch >= 2  # the streams shared rounds


async def test_concurrent_streams_interleave_and_each_gets_its_own_text(make_engine) -> None:
    engine, out = await make_engine(), Collector()
    prompts = {i: " ".join(f"s{i}w{j}" for j in range(12)) for i in range(1, 6)}
    for i, prompt in prompts.items():
        engine.submit(request(i, prompt), out)
    await out.wait(*prompts)
    for i, prompt in prompts.items():
        assert out.text(i) == prompt and out.end(i).output_tokens == 12
    assert engine.stats.max_decode_batch >= 2
    assert engine.stats.decode_steps_total < 5 * 12  # rounds were shared


async def test_a_generator_that_raises_fails_its_stream_alone(make_engine) -> None:
    engine, out = await make_engine(), Collector()
    engine.submit(request(1, "raise 3"), out)
    engine.submit(request(2, "invalid"), out)
    engine.submit(request(3, "bytes"), out)
    engine.submit(request(4, "still here"), out)
    await out.wait(1, 2, 3, 4)
    assert out.text(1) == "w0 w1 w2 "
    failed = out.end(1)
    assert isinstance(failed, InferError) and failed.code == "internal"
    assert "ValueError: asked to fail (at echo.py:" in failed.message
    assert out.end(2).code == "bad_input" and "this prompt is refused" in out.end(2).message
    assert "yielded bytes, not str" in out.end(3).message
    assert out.text(4) == "still here" and out.end(4).finish_reason == "stop"


async def test_a_hanging_generator_gets_its_worker_killed_and_the_next_stream_a_new_one(
    make_engine,
) -> None:
    engine, out = await make_engine(timeout_s=1), Collector()
    engine.submit(request(1, "hang"), out)
    engine.submit(request(2, "count", max_new_tokens=10_000 // 40), out)
    await out.wait(1, 2)
    assert out.text(1) == "waiting"
    for stream in (1, 2):  # the other stream shared the worker: it fails too, saying why
        failed = out.end(stream)
        assert isinstance(failed, InferError) and failed.code == "internal"
        assert "did not yield within the package's 1 s" in failed.message
    await until(lambda: engine._worker is None)
    engine.submit(request(3, "after the kill"), out)
    await out.wait(3)
    assert out.text(3) == "after the kill" and engine.runtime.restarts == 1


async def test_limits_are_refused_like_the_built_in_engines(make_engine) -> None:
    engine = await make_engine(max_streams=2, max_input_tokens=16, max_output_tokens=LONG)
    out = Collector()
    with pytest.raises(BadInput, match="at most 16"):
        engine.submit(request(1, "x" * 17), out)
    with pytest.raises(BadInput, match=f"at most {LONG}"):
        engine.submit(request(1, "x", max_new_tokens=LONG + 1), out)
    with pytest.raises(BadInput, match="at most 16 stop strings"):
        engine.submit(request(1, "x", stop=["s"] * 17), out)
    engine.submit(request(1, "count", max_new_tokens=LONG), out)
    engine.submit(request(2, "count", max_new_tokens=LONG), out)
    with pytest.raises(BadInput, match="already generating"):
        engine.submit(request(2, "x"), out)
    with pytest.raises(Overloaded):
        engine.submit(request(3, "x"), out)
    assert engine.counts.shed == 1
    await until(lambda: len(out.chunks(2)) >= 2)
    engine.cancel_all([out])  # the connection dropped: nothing more is sent to it
    assert engine.streams_active == 0 and engine.stats.streams_cancelled_total == 2
    sent = len(out.frames[1]) + len(out.frames[2])
    engine.submit(request(3, "room again"), out)
    await out.wait(3)
    assert out.text(3) == "room again"
    assert len(out.frames[1]) + len(out.frames[2]) == sent


async def test_stopping_fails_live_streams_as_unloaded(make_engine) -> None:
    engine, out = await make_engine(max_output_tokens=LONG), Collector()
    engine.submit(request(1, "count", max_new_tokens=LONG), out)
    await until(lambda: len(out.chunks(1)) >= 2)
    await engine.stop()
    assert out.end(1).code == "not_loaded"
    process = engine.runtime._process
    assert process is None


async def test_a_worker_that_breaks_the_protocol_is_killed(make_engine) -> None:
    engine, out = await make_engine(max_output_tokens=LONG), Collector()
    engine.submit(request(1, "count", max_new_tokens=LONG), out)
    await until(lambda: len(out.chunks(1)) >= 2)
    worker = engine._worker
    assert worker is not None
    # As though the worker named a stream it was never given.
    with pytest.raises(Exception, match="not live on it"):
        engine._step(worker, {"op": "step", "events": [{"id": 12345, "text": "x"}]})
    for bad in (
        {"op": "other"},
        {"op": "step", "events": [{"id": 1}]},
        {"op": "step", "events": [{"id": next(iter(worker.streams)), "text": 5}]},
    ):
        with pytest.raises(Exception):  # noqa: B017 - _Broken, private
            engine._step(worker, bad)


async def test_an_environment_built_by_an_older_agent_gets_this_agents_worker(
    sandbox: Path, tmp_path: Path
) -> None:
    from serving_agent._envs import Environments
    from serving_agent.package import read_package

    folder = PACKAGES / "word_echo"
    package = read_package(folder)
    envs = Environments(tmp_path / "envs")

    async def progress(detail: str) -> None:
        pass

    python = await envs.ensure(package, folder, progress)
    (worker,) = python.parent.parent.glob("lib/python*/site-packages/switchyard_client/model.py")
    current = worker.read_bytes()
    worker.write_bytes(b"# an older worker, without serve_streams\n")
    await envs.ensure(package, folder, progress)
    assert worker.read_bytes() == current
