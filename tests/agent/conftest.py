"""Fixtures for the serving agent tests: a tiny ONNX model and version specs for it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from serving_agent import Agent
from serving_agent.protocol import (
    AGENT_WS_PATH,
    ARTIFACT_PATH,
    InferRequest,
    TensorSpec,
    VersionSpec,
    encode_frame,
    pack_frames,
    tensor_of,
    unpack_frames,
)

TOKEN = "node-token"
ARTIFACT_PREFIX = ARTIFACT_PATH.split("{")[0]


def infer_frame(request_id: int, x: np.ndarray, version_id: int = 1, **kw: Any) -> bytes:
    """An infer request for input ``x``, as the platform frames it."""
    request = InferRequest(id=request_id, version_id=version_id, inputs=[tensor_of("x", x)], **kw)
    return encode_frame(request, [x])


def infer_message(request_id: int, x: np.ndarray, version_id: int = 1, **kw: Any) -> bytes:
    """One request as the websocket message the platform sends."""
    return pack_frames([infer_frame(request_id, x, version_id, **kw)])


@asynccontextmanager
async def until_stopped(
    run: Callable[[asyncio.Event], Coroutine[Any, Any, None]], timeout: float = 5.0
) -> AsyncIterator[None]:
    """``run(stop)`` in a task for the block; then ``stop`` is set and it must return in time."""
    stop = asyncio.Event()
    task = asyncio.create_task(run(stop))
    try:
        yield
    finally:
        stop.set()
        async with asyncio.timeout(timeout):
            await task


@asynccontextmanager
async def running(agent: Agent, timeout: float = 5.0) -> AsyncIterator[Agent]:
    """The agent connected (or connecting) for the block; stopped and its cache closed after."""
    try:
        async with until_stopped(agent.run, timeout):
            yield agent
    finally:
        agent.cache.close()


@dataclass
class TinyModel:
    """A 4 -> 8 -> 2 MLP exported to ONNX with a dynamic batch axis."""

    path: Path
    data: bytes
    sha256: str


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    path = tmp_path_factory.mktemp("model") / "mlp.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter warns it is legacy; it is simplest
        torch.onnx.export(
            model,
            (torch.zeros(1, 4),),
            str(path),
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
        )
    data = path.read_bytes()
    return TinyModel(path=path, data=data, sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture
def make_spec(tiny_model: TinyModel) -> Callable[..., VersionSpec]:
    """Build a VersionSpec for the tiny model; keyword arguments override any field."""

    def make(**overrides: Any) -> VersionSpec:
        version_id = overrides.get("version_id", 1)
        fields: dict[str, Any] = {
            "version_id": version_id,
            "model": "mlp",
            "version": 1,
            "sha256": tiny_model.sha256,
            "artifact_url": ARTIFACT_PATH.format(version_id=version_id),
            "inputs": [TensorSpec(name="x", datatype="FP32", shape=[-1, 4])],
            "outputs": [TensorSpec(name="y", datatype="FP32", shape=[-1, 2])],
            "max_batch_size": 8,
            "device": "cpu",
        }
        fields.update(overrides)
        return VersionSpec(**fields)

    return make


class FakePlatform:
    """The platform side of the wire, on loopback: the agent websocket and artifact downloads.

    Messages from agents land in ``messages`` (JSON) and ``frames`` (binary frames, unpacked
    from their websocket messages); ``log`` keeps every JSON message in order for assertions
    about what was *not* sent.
    """

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.artifacts: dict[int, bytes] = {}
        self.auth_headers: list[str | None] = []
        self.downloads: list[int] = []
        self.log: list[dict[str, Any]] = []
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.frames: asyncio.Queue[bytes] = asyncio.Queue()
        self.connections: asyncio.Queue[ServerConnection] = asyncio.Queue()
        self.close_code: int | None = None  # close every connection at once with this code
        self.url = ""
        self._server: Server | None = None

    async def start(self) -> None:
        self._server = await serve(
            self._handler,
            "127.0.0.1",
            0,
            process_request=self._process_request,
            compression=None,
            max_size=64 * 1024 * 1024,
        )
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def expect(self, kind: str, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
        """The next message of ``kind`` with these field values, skipping any others."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.messages.get()
                if message["type"] == kind and all(message.get(k) == v for k, v in fields.items()):
                    return message

    async def next_frame(self, timeout: float = 5.0) -> bytes:
        async with asyncio.timeout(timeout):
            return await self.frames.get()

    async def next_connection(self, timeout: float = 5.0) -> ServerConnection:
        async with asyncio.timeout(timeout):
            return await self.connections.get()

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        authorized = request.headers.get("Authorization") == f"Bearer {self.token}"
        if request.path.startswith(ARTIFACT_PREFIX):
            if not authorized:
                return connection.respond(403, "bad token\n")
            version_id = int(request.path.removeprefix(ARTIFACT_PREFIX))
            self.downloads.append(version_id)
            body = self.artifacts[version_id]
            headers = Headers(
                [("Content-Type", "application/octet-stream"), ("Content-Length", str(len(body)))]
            )
            return Response(200, "OK", headers, body)
        if request.path != AGENT_WS_PATH:
            return connection.respond(404, "not found\n")
        self.auth_headers.append(request.headers.get("Authorization"))
        return None if authorized else connection.respond(403, "bad token\n")

    async def _handler(self, ws: ServerConnection) -> None:
        await self.connections.put(ws)
        if self.close_code is not None:
            await ws.close(self.close_code, "bad token")
            return
        try:
            async for message in ws:
                if isinstance(message, bytes):
                    for frame in unpack_frames(message):
                        await self.frames.put(frame)
                else:
                    self.log.append(json.loads(message))
                    await self.messages.put(self.log[-1])
        except ConnectionClosed:
            pass  # tests drop connections on purpose


@pytest.fixture
async def platform(tiny_model: TinyModel) -> AsyncIterator[FakePlatform]:
    fake = FakePlatform()
    fake.artifacts[1] = tiny_model.data
    await fake.start()
    yield fake
    await fake.stop()
