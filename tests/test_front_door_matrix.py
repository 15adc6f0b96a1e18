"""Every front door through the one lifecycle (gateway/frontdoor.py): the same cases through
OIP REST, OIP gRPC, the prediction API, embeddings, OpenAI's completions and chat, and the
generation websocket, each answered in its own protocol's shape with the same status family,
the same refusal metric, and the Idempotency-Key released on every exit without an answer (or
with one too large to keep, which says so).

No process is started: the HTTP doors are driven through the ASGI application, the gRPC door's
handler is called with a fake servicer context, and the agents are in-process links."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
import redis
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import ApplicationCommunicator, WebsocketCommunicator
from django.core.files.base import ContentFile

from gateway import embeddings, generate_ws, grpc_server, idempotency, oip, openai_api
from gateway import state as state_module
from gateway.api import predict_app, views
from gateway.dispatch import AgentLink
from gateway.grpc_codec import GRPC_CODE
from gateway.proto import grpc_predict_v2_pb2 as pb
from gateway.state import GatewayState
from platform_site.asgi import application
from platform_site.routing import websocket_urlpatterns
from registry.models import ArtifactFormat, ModelVersion
from registry.services import TEXTGEN_INPUTS, TEXTGEN_OUTPUTS, set_alias
from serving_agent._serving import result_frame
from serving_agent.protocol import (
    GenerateDone,
    GenerateRequest,
    InferRequest,
    TokenChunk,
    decode_frame,
    encode_frame,
    error_frame,
    unpack_frames,
)
from tenants.stream_budget import BudgetExceeded
from tests.factories import make_model

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.backends]

TENSOR_INPUTS = [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
TENSOR_OUTPUTS = [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]
TEXT_INPUTS = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
TEXT_OUTPUTS = [
    {"name": "emb", "datatype": "FP32", "shape": [-1, 4]},
    {"name": "token_count", "datatype": "INT64", "shape": [-1]},
]


class Agent:
    """One in-process agent link for every version of the test: it answers, fails with an
    internal error, or holds each request (never answers), as ``mode`` says."""

    def __init__(self, state: GatewayState, version_ids: list[int]) -> None:
        self.pool = state.pool
        self.mode = "answer"
        self.received = 0
        self.link = AgentLink("matrix", self.receive)
        self.pool.add(self.link)
        for version_id in version_ids:
            self.pool.set_ready(self.link, version_id, True)

    async def receive(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            header, arrays = decode_frame(frame)
            if not isinstance(header, InferRequest | GenerateRequest):
                continue  # a cancel
            self.received += 1
            if self.mode == "hold":
                continue
            if self.mode == "fail":
                reply = error_frame(header.id, "internal", "the runtime crashed")
                self.pool.deliver(self.link, reply)
            elif isinstance(header, GenerateRequest):
                self.pool.deliver(self.link, encode_frame(TokenChunk(header.id, "ok", 1)))
                done = GenerateDone(header.id, "stop", 2, 1, 1.0, 2.0)
                self.pool.deliver(self.link, encode_frame(done))
            elif header.inputs[0].datatype == "BYTES":  # embeddings: one vector per text
                rows = len(arrays[0])
                vectors = np.ones((rows, 4), np.float32)
                counts = np.full(rows, 3, np.int64)
                reply = result_frame(header.id, ["emb", "token_count"], [vectors, counts])
                self.pool.deliver(self.link, reply)
            else:
                rows = len(arrays[0])
                reply = result_frame(header.id, ["y"], [np.zeros((rows, 2), np.float32)])
                self.pool.deliver(self.link, reply)


def make_row(model: Any, fmt: str, inputs: list, outputs: list, text: bool = False) -> int:
    """A version served by the fake agent (no artifact is ever loaded)."""
    version = ModelVersion(
        model=model,
        version=1,
        sha256=f"{model.pk:064x}",
        format=fmt,
        inputs=inputs,
        outputs=outputs,
        max_output_tokens=64,
    )
    version.artifact.save(f"{version.sha256}.bin", ContentFile(b"weights"), save=False)
    if text:
        version.tokenizer.save(f"{version.sha256}.json", ContentFile(b"{}"), save=False)
    version.save()
    set_alias(model, "production", version)
    return version.pk


@pytest.fixture
def site(world, monkeypatch):
    """Tenant A's ``clf`` (tensors), ``emb`` (embeddings) and ``writer`` (generation); tenant
    B's ``secret``, which A's key must not find. One gateway state for every door."""
    if os.environ.get("REDIS_URL"):
        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        for prefix in (idempotency.REDIS_PREFIX, "sy:gen:"):
            for name in client.scan_iter(prefix + "*"):
                client.delete(name)
    gateway = GatewayState()
    modules = (oip, predict_app, views, state_module, openai_api, embeddings, grpc_server)
    for module in (*modules, generate_ws):
        monkeypatch.setattr(module, "get_state", lambda: gateway)
    ids = [
        make_row(make_model(world.a, "clf"), ArtifactFormat.ONNX, TENSOR_INPUTS, TENSOR_OUTPUTS),
        make_row(
            make_model(world.a, "emb", task="embedding"),
            ArtifactFormat.ONNX,
            TEXT_INPUTS,
            TEXT_OUTPUTS,
            text=True,
        ),
        make_row(
            make_model(world.a, "writer", task="generator"),
            ArtifactFormat.TEXTGEN,
            TEXTGEN_INPUTS,
            TEXTGEN_OUTPUTS,
        ),
        make_row(make_model(world.b, "secret"), ArtifactFormat.ONNX, TENSOR_INPUTS, TENSOR_OUTPUTS),
    ]
    world.state = gateway
    world.ids = ids
    return world


# The doors -----------------------------------------------------------------------------------


@dataclass
class Sent:
    """What a door answered: an HTTP status (the gRPC code and the websocket's error code are
    mapped back through their doors' own tables), the replay mark, whether the client was gone
    before any answer, and whether the answer was kept for its retries (no
    ``Idempotency-Stored: false``)."""

    status: int
    replayed: bool = False
    gone: bool = False
    stored: bool = True


@dataclass
class Request:
    key: str | None
    model: str  # "clf" is the door's own model; the door substitutes its kind
    bad: bool = False
    idem: str | None = None
    leave_after_s: float | None = None  # the client goes away after this long


async def http(path: str, body: bytes, req: Request) -> Sent:
    headers = [(b"content-type", b"application/json")]
    if req.key is not None:
        headers.append((b"authorization", f"Bearer {req.key}".encode()))
    if req.idem is not None:
        headers.append((b"idempotency-key", req.idem.encode()))
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "scheme": "http",
        "headers": headers,
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    communicator = ApplicationCommunicator(application, scope)
    await communicator.send_input({"type": "http.request", "body": body, "more_body": False})
    if req.leave_after_s is not None:
        await asyncio.sleep(req.leave_after_s)
        await communicator.send_input({"type": "http.disconnect"})
        # A lean door answers a 499 nobody reads; Django's handler cancels the view and sends
        # nothing.
        try:
            await communicator.wait(timeout=5)
        except TimeoutError:
            pytest.fail(f"{path} still runs after its client left")
        return Sent(0, gone=True)
    start = await communicator.receive_output(timeout=10)
    got = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    await communicator.receive_output(timeout=10)  # the body
    stored = got.get("idempotency-stored") != "false"
    return Sent(start["status"], got.get("idempotent-replayed") == "true", stored=stored)


def oip_door(req: Request) -> Awaitable[Sent]:
    data = "not a number" if req.bad else [0.5] * 4
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": data}]}
    return http(f"/v2/models/{req.model}/infer", json.dumps(body).encode(), req)


def predict_door(req: Request) -> Awaitable[Sent]:
    body = {"inputs": {"x": [[0.5] * 3 if req.bad else [0.5] * 4]}}
    return http(f"/api/v1/models/{req.model}/predict", json.dumps(body).encode(), req)


def embeddings_door(req: Request) -> Awaitable[Sent]:
    model = "emb" if req.model == "clf" else req.model
    body = {"model": model, "input": "" if req.bad else "hello"}
    return http("/v1/embeddings", json.dumps(body).encode(), req)


def completions_door(req: Request) -> Awaitable[Sent]:
    model = "writer" if req.model == "clf" else req.model
    body = {"model": model, "prompt": "hi", "max_tokens": 0 if req.bad else 4}
    return http("/v1/completions", json.dumps(body).encode(), req)


def chat_door(req: Request) -> Awaitable[Sent]:
    model = "writer" if req.model == "clf" else req.model
    messages = [] if req.bad else [{"role": "user", "content": "hi"}]
    body = {"model": model, "messages": messages, "max_tokens": 4}
    return http("/v1/chat/completions", json.dumps(body).encode(), req)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code


class FakeContext:
    """The servicer context ``grpc.aio`` hands a handler, as far as the handler uses it."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata
        self.trailers: list[tuple[str, str]] = []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, trailers: list[tuple[str, str]]) -> None:
        self.trailers = list(trailers)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code)


# RESOURCE_EXHAUSTED answers both 413 and 429: here it is the rate limit.
HTTP_OF_GRPC = {code: status for status, code in GRPC_CODE.items() if status != 413}


async def grpc_door(req: Request) -> Sent:
    request = pb.ModelInferRequest(model_name=req.model)
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 3 if req.bad else 4])
    tensor.contents.fp32_contents.extend([0.5] * (3 if req.bad else 4))
    metadata = [("authorization", f"Bearer {req.key}")] if req.key is not None else []
    if req.idem is not None:
        metadata.append(("idempotency-key", req.idem))
    context = FakeContext(metadata)
    task = asyncio.ensure_future(grpc_server.model_infer(request, context))  # type: ignore[arg-type]
    if req.leave_after_s is not None:
        await asyncio.sleep(req.leave_after_s)
        task.cancel()  # what grpc.aio does to a handler whose client cancelled the call
        await asyncio.gather(task, return_exceptions=True)
        return Sent(0, gone=True)
    try:
        await task
    except Aborted as exc:
        if exc.code is grpc.StatusCode.INTERNAL:
            return Sent(500)
        return Sent(HTTP_OF_GRPC[exc.code])
    stored = ("idempotency-stored", "false") not in context.trailers
    return Sent(200, ("idempotent-replayed", "true") in context.trailers, stored=stored)


HTTP_OF_WS = {code: status for status, code in generate_ws.CODES.items()} | {"internal": 500}


async def ws_door(req: Request) -> Sent:
    model = "writer" if req.model == "clf" else req.model
    headers = [(b"authorization", f"Bearer {req.key}".encode())] if req.key is not None else []
    communicator = WebsocketCommunicator(
        URLRouter(websocket_urlpatterns), f"/ws/v1/models/{model}/generate", headers=headers
    )
    connected, _ = await communicator.connect()
    assert connected
    try:
        if not await communicator.receive_nothing(timeout=0.2):  # refused on the handshake
            frame = await communicator.receive_json_from()
            return Sent(HTTP_OF_WS[frame["code"]])
        message = {"type": "generate", "id": "g", "prompt": "hi", "max_tokens": 4}
        if req.bad:
            message["max_tokens"] = 0
        await communicator.send_json_to(message)
        if req.leave_after_s is not None:
            await asyncio.sleep(req.leave_after_s)
            return Sent(0, gone=True)
        while True:
            frame = await communicator.receive_json_from(timeout=10)
            if frame["type"] == "error":
                return Sent(HTTP_OF_WS[frame["code"]])
            if frame["type"] == "done":
                return Sent(200)
    finally:
        await communicator.disconnect()


Door = Callable[[Request], Awaitable[Sent]]
DOORS: dict[str, Door] = {
    "oip": oip_door,
    "grpc": grpc_door,
    "predict": predict_door,
    "embeddings": embeddings_door,
    "completions": completions_door,
    "chat": chat_door,
    "websocket": ws_door,
}
# The doors that take an Idempotency-Key (a stream, and so the socket, cannot be replayed).
IDEMPOTENT = ("oip", "grpc", "predict", "embeddings", "completions", "chat")
GENERATES = ("completions", "chat", "websocket")


# The cases -----------------------------------------------------------------------------------


@dataclass
class Case:
    status: int  # the family every door answers in: its own shape of this status
    reason: str | None  # the refusal metric's reason (None: not a refusal)
    build: Callable[[Any, str], Request]
    arrange: Callable[[Any, str], None] = lambda site, door: None


def over_quota(site: Any, door: str) -> None:
    """The tenant's request rate (tensor doors) or stream budget (generation) is spent."""

    async def no_tokens(*_args: object) -> float:
        return 1.0

    async def no_streams(*_args: object) -> str:
        raise BudgetExceeded("the tenant's streams are spent", 1.0)

    site.state.limiter.acquire = no_tokens
    site.state.streams.admit = no_streams


def agent_fails(site: Any, door: str) -> None:
    site.agent.mode = "fail"


def deadline_passes(site: Any, door: str) -> None:
    site.agent.mode = "hold"
    site.state.infer_timeout = 0.2


CASES = {
    "no_key": Case(401, "unauthenticated", lambda s, d: Request(None, "clf")),
    "bad_key": Case(401, "unauthenticated", lambda s, d: Request("sy_wrong", "clf")),
    "other_tenant": Case(404, "not_found", lambda s, d: Request(s.key_a, "secret")),
    "over_quota": Case(429, "rate_limit", lambda s, d: Request(s.key_a, "clf"), over_quota),
    "bad_input": Case(400, "bad_input", lambda s, d: Request(s.key_a, "clf", bad=True)),
    "agent_error": Case(500, None, lambda s, d: Request(s.key_a, "clf"), agent_fails),
    "deadline": Case(504, None, lambda s, d: Request(s.key_a, "clf"), deadline_passes),
}


def run(site: Any, scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        site.agent = Agent(site.state, site.ids)
        return await scenario()

    return async_to_sync(main)()


def refusals(state: GatewayState) -> dict[str, int]:
    counts: dict[str, int] = {}
    for (_tenant, reason), n in state.metrics.rejected.items():
        counts[reason] = counts.get(reason, 0) + n
    return counts


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("door", DOORS)
def test_every_door_answers_each_case_alike(site, door, case):
    want = CASES[case]

    async def scenario() -> Sent:
        want.arrange(site, door)
        return await DOORS[door](want.build(site, door))

    sent = run(site, scenario)
    assert sent.status == want.status, f"{door} answered {case} with {sent.status}"
    expected = {want.reason: 1} if want.reason else {}
    assert refusals(site.state) == expected
    # A refusal before the key's in-flight place was taken, or after it was given back.
    assert not site.state.in_flight.counts


@pytest.mark.parametrize("door", IDEMPOTENT)
@pytest.mark.parametrize("exit_", ["agent_error", "client_gone"])
def test_a_request_ended_without_an_answer_frees_its_key_for_the_retry(site, door, exit_):
    """An agent error, or a client that leaves while a cold start holds its request: the
    retry with the same Idempotency-Key is computed (200), not refused with 409."""

    async def scenario() -> tuple[Sent, Sent]:
        if exit_ == "agent_error":
            site.agent.mode = "fail"
            first = await DOORS[door](Request(site.key_a, "clf", idem="k-1"))
        else:
            ready = site.state.ready

            async def cold_start(*_args: object, **_kwargs: object) -> None:
                await asyncio.Event().wait()  # the replica never becomes ready

            site.state.ready = cold_start
            first = await DOORS[door](Request(site.key_a, "clf", idem="k-1", leave_after_s=0.2))
            site.state.ready = ready
            await asyncio.sleep(0.1)  # a cancelled task's release runs in the background
        site.agent.mode = "answer"
        retry = await DOORS[door](Request(site.key_a, "clf", idem="k-1"))
        return first, retry

    first, retry = run(site, scenario)
    assert first.gone if exit_ == "client_gone" else first.status == 500
    assert retry.status == 200 and not retry.replayed
    assert not site.state.in_flight.counts


@pytest.mark.parametrize("door", IDEMPOTENT)
def test_an_answered_request_is_replayed_and_computed_once(site, door):
    async def scenario() -> tuple[Sent, Sent]:
        first = await DOORS[door](Request(site.key_a, "clf", idem="k-2"))
        return first, await DOORS[door](Request(site.key_a, "clf", idem="k-2"))

    first, second = run(site, scenario)
    assert first.status == second.status == 200
    assert second.replayed and not first.replayed
    assert first.stored and second.stored
    assert site.agent.received == 1
    # A replay computes nothing: it is not counted again.
    assert refusals(site.state) == {}


@pytest.mark.parametrize("door", IDEMPOTENT)
def test_an_answer_too_large_to_keep_says_so_and_its_retry_computes(site, door):
    answers = site.state.answers
    getattr(answers, "local", answers).answer_bytes = 10  # RedisAnswers reads its local's

    async def scenario() -> tuple[Sent, Sent]:
        first = await DOORS[door](Request(site.key_a, "clf", idem="k-3"))
        return first, await DOORS[door](Request(site.key_a, "clf", idem="k-3"))

    first, retry = run(site, scenario)
    assert first.status == retry.status == 200
    assert not first.stored and not retry.stored and not retry.replayed
    assert site.agent.received == 2


@pytest.mark.parametrize("door", [d for d in DOORS if d not in GENERATES])
def test_answered_predictions_are_counted_per_version(site, door):
    run(site, lambda: DOORS[door](Request(site.key_a, "clf")))
    statuses = [key[-1] for key in site.state.metrics.requests]
    assert statuses == ["200"]
