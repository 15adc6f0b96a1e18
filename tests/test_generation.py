"""Token streaming at the gateway, in process: the client websocket and the OpenAI-compatible API
against a fake agent link in the pool (the real agent is in tests/agent and tests/e2e)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import asynccontextmanager

import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.core.files.base import ContentFile
from django.test import AsyncClient

from gateway import generate_ws, openai_api
from gateway.dispatch import (
    STREAM_BUFFER,
    AgentLink,
    AgentPool,
    DispatchError,
    SlowClient,
    StreamInbox,
)
from gateway.state import GatewayState
from platform_site.routing import websocket_urlpatterns
from registry.models import ArtifactFormat, ModelVersion
from registry.services import TEXTGEN_INPUTS, TEXTGEN_OUTPUTS, set_alias
from serving_agent.protocol import (
    BATCH,
    INTERACTIVE,
    SHADOW,
    CancelGenerate,
    GenerateDone,
    GenerateRequest,
    InferResult,
    TokenChunk,
    decode_frame,
    encode_frame,
    error_frame,
    unpack_frames,
)
from tests.factories import make_key, make_model, make_version
from tests.onnx_models import small_onnx


class FakeAgent:
    """A link in the pool that streams the prompt back upper-cased, one character a chunk."""

    def __init__(self, state: GatewayState, version_id: int, delay: float = 0.0):
        self.pool = state.pool
        self.delay = delay
        self.requests: list[GenerateRequest] = []
        self.cancelled: list[int] = []
        self.link = AgentLink("fake", self.receive)
        self.pool.add(self.link)
        self.pool.set_ready(self.link, version_id, True)

    async def receive(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            header, _ = decode_frame(frame)
            if isinstance(header, GenerateRequest):
                self.requests.append(header)
                asyncio.get_running_loop().create_task(self.stream(header))
            elif isinstance(header, CancelGenerate):
                self.cancelled.append(header.id)

    async def stream(self, request: GenerateRequest) -> None:
        text = request.prompt.upper()[: request.max_new_tokens]
        for char in text:
            await asyncio.sleep(self.delay)
            if request.id in self.cancelled:
                return
            self.pool.deliver(self.link, encode_frame(TokenChunk(request.id, char, 1)))
        done = GenerateDone(request.id, "length", len(request.prompt), len(text), 1.0, 2.0)
        self.pool.deliver(self.link, encode_frame(done))


def make_textgen(model, alias: str | None = "production", **limits) -> ModelVersion:
    number = model.versions.count() + 1
    version = ModelVersion(
        model=model,
        version=number,
        sha256=f"{number:064x}",
        format=ArtifactFormat.TEXTGEN,
        inputs=TEXTGEN_INPUTS,
        outputs=TEXTGEN_OUTPUTS,
        **limits,
    )
    version.artifact.save(f"{version.sha256}.textgen", ContentFile(b"weights"), save=False)
    version.save()
    if alias:
        set_alias(model, alias, version)
    return version


# The consumers reach the database from worker threads: committed data, real connections.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.backends]


@pytest.fixture
def writer(world):
    model = make_model(world.a, "writer", task="generator")
    world.version = make_textgen(model, max_input_tokens=40, max_output_tokens=64)
    return world


@pytest.fixture
def state(monkeypatch):
    """A gateway state of the test's own (no refresh loop), used by both front doors; on
    Redis, the tenants' generation budgets start empty."""
    if os.environ.get("REDIS_URL"):
        import redis

        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        for key in client.scan_iter("sy:gen:*"):
            client.delete(key)
    holder: dict[str, GatewayState] = {}

    def get_state() -> GatewayState:
        if "state" not in holder:
            holder["state"] = GatewayState()
        return holder["state"]

    monkeypatch.setattr(generate_ws, "get_state", get_state)
    monkeypatch.setattr(openai_api, "get_state", get_state)
    return get_state


@asynccontextmanager
async def socket(key: str | None, model: str = "writer", headers: list | None = None):
    headers = list(headers or [])
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    communicator = WebsocketCommunicator(
        URLRouter(websocket_urlpatterns), f"/ws/v1/models/{model}/generate", headers=headers
    )
    connected, _ = await communicator.connect()
    assert connected
    try:
        yield communicator
    finally:
        await communicator.disconnect()


async def frames_until_end(communicator, *stream_ids: str) -> list[dict]:
    """Frames up to the done or error frame of each of the given generations."""
    got, open_ids = [], set(stream_ids)
    while open_ids:
        frame = await communicator.receive_json_from(timeout=5)
        got.append(frame)
        if frame["type"] in ("done", "error"):
            open_ids.discard(frame.get("id"))
    return got


def run(coro_fn):
    return async_to_sync(coro_fn)()


def test_tokens_stream_then_a_done_frame_with_usage(writer, state):
    async def scenario():
        FakeAgent(state(), writer.version.pk)
        async with socket(writer.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g1", "prompt": "call me", "seed": 1})
            return await frames_until_end(ws, "g1")

    frames = run(scenario)
    tokens = [f for f in frames if f["type"] == "token"]
    assert "".join(t["text"] for t in tokens) == "CALL ME" and len(tokens) == 7
    done = frames[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert (done["model"], done["version"], done["arm"]) == ("writer", 1, None)
    usage = done["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (7, 7)
    assert usage["ttft_ms"] is not None and usage["total_ms"] >= usage["ttft_ms"]


def test_inter_token_latency_is_observed_per_token_after_the_first(writer, state):
    """One observation per token after the first, whose sum is the time from the first chunk
    to the last as the gateway saw it."""
    from gateway import metrics

    child = metrics.ITL.labels(writer.a.slug, "writer", "1")

    def observed() -> tuple[float, float]:
        samples = {s.name: s.value for s in child.collect()[0].samples}
        return samples["switchyard_generation_inter_token_latency_seconds_count"], samples[
            "switchyard_generation_inter_token_latency_seconds_sum"
        ]

    async def scenario():
        FakeAgent(state(), writer.version.pk, delay=0.01)
        async with socket(writer.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "call me"})
            return await frames_until_end(ws, "g")

    count, total = observed()
    usage = run(scenario)[-1]["usage"]
    count_after, total_after = observed()
    assert count_after - count == usage["output_tokens"] - 1 == 6
    decode_s = (usage["total_ms"] - usage["ttft_ms"]) / 1000
    assert 6 * 0.01 <= total_after - total <= decode_s  # each chunk came >= 10 ms after the last


def test_several_generations_share_one_socket(writer, state):
    async def scenario():
        FakeAgent(state(), writer.version.pk, delay=0.005)
        async with socket(writer.key_a) as ws:
            for name in ("a", "b"):
                await ws.send_json_to({"type": "generate", "id": name, "prompt": name * 5})
            texts: dict[str, str] = {"a": "", "b": ""}
            done = set()
            while done != {"a", "b"}:
                frame = await ws.receive_json_from(timeout=5)
                if frame["type"] == "token":
                    texts[frame["id"]] += frame["text"]
                elif frame["type"] == "done":
                    done.add(frame["id"])
            return texts

    assert run(scenario) == {"a": "AAAAA", "b": "BBBBB"}


def test_key_in_the_first_message_and_bad_keys(writer, state):
    async def scenario():
        FakeAgent(state(), writer.version.pk)
        async with socket(None) as ws:
            await ws.send_json_to({"type": "auth", "api_key": writer.key_a})
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "ok"})
            good = await frames_until_end(ws, "g")
        async with socket("sy_bad_key") as ws:
            refused = await ws.receive_json_from(timeout=5)
            closed = await ws.receive_output(timeout=5)
        async with socket(None) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "ok"})
            early = await ws.receive_json_from(timeout=5)
        return good, refused, closed, early

    good, refused, closed, early = run(scenario)
    assert good[-1]["type"] == "done"
    assert refused["code"] == "unauthorized" and "invalid or revoked" in refused["message"]
    assert closed == {"type": "websocket.close", "code": 4401}
    assert early["code"] == "unauthorized" and "authenticate first" in early["message"]


@pytest.mark.parametrize(
    "message, code, words",
    [
        ("{not json", "bad_request", "malformed JSON"),
        ('{"type": "dance"}', "bad_request", "expected"),
        ('{"type": "generate", "id": "g"}', "bad_request", "prompt"),
        ('{"type": "generate", "id": "g", "prompt": "x", "top_p": 0}', "bad_request", "top_p"),
        ('{"type": "generate", "id": "g", "prompt": "x", "bogus": 1}', "bad_request", "bogus"),
        ('{"type": "generate", "id": "g", "prompt": "' + "x" * 41 + '"}', "bad_request", "41"),
        ('{"type": "generate", "id": "g", "prompt": "x", "max_tokens": 65}', "bad_request", "64"),
    ],
)
def test_bad_frames_get_an_error_frame_and_the_socket_stays_open(
    writer, state, message, code, words
):
    async def scenario():
        FakeAgent(state(), writer.version.pk)
        async with socket(writer.key_a) as ws:
            await ws.send_to(text_data=message)
            error = await ws.receive_json_from(timeout=5)
            await ws.send_json_to({"type": "generate", "id": "after", "prompt": "still here"})
            after = await frames_until_end(ws, "after")
        return error, after

    error, after = run(scenario)
    assert error["type"] == "error" and error["code"] == code and words in error["message"]
    assert after[-1]["type"] == "done"


def test_unknown_other_tenants_and_tensor_models(writer, state):
    make_textgen(make_model(writer.b, "theirs", task="generator"))
    make_version(make_model(writer.a, "clf"), small_onnx())

    async def scenario():
        answers = {}
        for model in ("nope", "theirs", "clf"):
            async with socket(writer.key_a, model) as ws:
                await ws.send_json_to({"type": "generate", "id": "g", "prompt": "x"})
                answers[model] = await ws.receive_json_from(timeout=5)
        return answers

    answers = run(scenario)
    assert answers["nope"]["code"] == "not_found" and answers["theirs"]["code"] == "not_found"
    assert answers["clf"]["code"] == "bad_request"
    assert "does not generate text" in answers["clf"]["message"]


def test_tenant_stream_and_token_budgets(writer, state):
    from tenants.models import Quota

    Quota.objects.filter(tenant=writer.a).update(max_concurrent_streams=1, tokens_per_minute=12)

    async def scenario():
        FakeAgent(state(), writer.version.pk, delay=0.02)
        async with socket(writer.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "one", "prompt": "abcdef"})
            await ws.send_json_to({"type": "generate", "id": "two", "prompt": "abcdef"})
            frames = await frames_until_end(ws, "one", "two")
            await ws.send_json_to({"type": "generate", "id": "three", "prompt": "abc"})
            frames += await frames_until_end(ws, "three")
        return frames

    frames = run(scenario)
    ends = {f["id"]: f for f in frames if f["type"] in ("done", "error")}
    # Both streams start at once: whichever is admitted first holds the one slot.
    assert sorted(ends[i]["type"] for i in ("one", "two")) == ["done", "error"]
    refused = next(ends[i] for i in ("one", "two") if ends[i]["type"] == "error")
    assert refused["code"] == "rate_limited" and "concurrent streams" in refused["message"]
    # 6 prompt + 6 generated tokens spent the 12 a minute: the next stream waits.
    assert ends["three"]["code"] == "rate_limited" and "token budget" in ends["three"]["message"]


def test_cancel_and_closing_the_socket_stop_the_agent(writer, state):
    async def scenario():
        agent = FakeAgent(state(), writer.version.pk, delay=0.02)
        async with socket(writer.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "x" * 30})
            await ws.receive_json_from(timeout=5)  # the first token
            await ws.send_json_to({"type": "cancel", "id": "g"})
            frames = await frames_until_end(ws, "g")
            await ws.send_json_to({"type": "generate", "id": "h", "prompt": "y" * 30})
            await ws.receive_json_from(timeout=5)
        await asyncio.sleep(0.05)  # the disconnect's cancel reaches the agent
        return agent, frames

    agent, frames = run(scenario)
    assert frames[-1] == {"type": "done", "id": "g", "finish_reason": "cancelled"}
    assert agent.cancelled == [r.id for r in agent.requests]  # both: cancel, then close
    assert not state().pool._links[0].streams  # nothing left in flight


def test_an_agent_lost_mid_stream_ends_it_with_an_error_frame(writer, state):
    async def scenario():
        agent = FakeAgent(state(), writer.version.pk, delay=0.02)
        async with socket(writer.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "x" * 30})
            await ws.receive_json_from(timeout=5)
            state().pool.remove(agent.link, "the serving agent disconnected during the request")
            return await frames_until_end(ws, "g")

    error = run(scenario)[-1]
    assert error["type"] == "error" and error["code"] == "agent_failed"
    assert "disconnected" in error["message"]


def test_a_client_that_does_not_read_is_cut_off_not_buffered():
    sent: list[bytes] = []

    async def send(frame: bytes) -> None:
        sent.append(frame)

    async def scenario():
        stream = StreamInbox(7, send)
        streams = {7: stream}
        for _ in range(STREAM_BUFFER):
            assert stream.push(TokenChunk(7, "x", 1))
        AgentPool._feed(streams, TokenChunk(7, "x", 1))  # one more than the buffer holds
        await asyncio.sleep(0)
        with pytest.raises(SlowClient):
            await stream.next(1.0)
        return streams

    streams = run(scenario)
    assert streams == {} and isinstance(decode_frame(sent[0])[0], CancelGenerate)


def test_a_frame_of_the_wrong_kind_from_an_agent_fails_the_request_with_502():
    """A stream's frame cannot answer a request, nor a result a stream: the agent broke the
    protocol, and the caller gets a 502 instead of a reply it cannot read."""

    async def send(frame: bytes) -> None:
        pass

    async def scenario():
        pool = AgentPool()
        link = AgentLink("fake", send)
        pool.add(link)
        pool.set_ready(link, 1, True)
        request = asyncio.ensure_future(pool.infer(1, [], [], None, 1.0))
        await asyncio.sleep(0)  # the request is sent and waits for its answer
        (request_id,) = link.pending
        pool.deliver(link, encode_frame(TokenChunk(request_id, "x", 1)))
        with pytest.raises(DispatchError) as request_failed:
            await request
        stream = await pool.open_stream(GenerateRequest(id=0, version_id=1, prompt="x"))
        pool.deliver(link, encode_frame(InferResult(stream.id, [])))
        with pytest.raises(DispatchError) as stream_failed:
            await stream.next(1.0)
        return request_failed.value, stream_failed.value

    request_error, stream_error = run(scenario)
    assert request_error.status == 502 and "TokenChunk" in request_error.message
    assert stream_error.status == 502 and "result" in stream_error.message


def test_the_playground_streams_with_the_signed_in_session(writer, state, client):
    client.force_login(writer.engineer_a)
    page = client.get("/models/writer/playground/")
    assert page.status_code == 200 and b'data-model="writer"' in page.content
    cookie = (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())

    async def scenario():
        FakeAgent(state(), writer.version.pk)
        same_site = [cookie, (b"host", b"localhost:8000"), (b"origin", b"http://localhost:8000")]
        async with socket(None, headers=same_site) as ws:
            await ws.send_json_to({"type": "generate", "id": "p", "prompt": "hi"})
            done = (await frames_until_end(ws, "p"))[-1]
        other_site = [cookie, (b"origin", b"http://evil.example")]
        async with socket(None, headers=other_site) as ws:
            await ws.send_json_to({"type": "generate", "id": "p", "prompt": "hi"})
            refused = await ws.receive_json_from(timeout=5)
        return done, refused

    done, refused = run(scenario)
    assert done["type"] == "done" and done["usage"]["output_tokens"] == 2
    assert refused["code"] == "unauthorized"


def test_the_playground_of_another_tenants_model_is_404(writer, client):
    client.force_login(writer.engineer_a)
    make_textgen(make_model(writer.b, "theirs", task="generator"))
    assert client.get("/models/theirs/playground/").status_code == 404


# OpenAI-compatible HTTP ----------------------------------------------------------------------


def openai_post(key: str, path: str, body: dict):
    async def call():
        response = await AsyncClient().post(
            path, body, content_type="application/json", headers={"Authorization": f"Bearer {key}"}
        )
        if response.streaming:
            text = "".join([part.decode() async for part in response.streaming_content])
            return response, text
        return response, response.json()

    return call


def test_openai_completion_whole_and_streamed(writer, state):
    async def scenario():
        FakeAgent(state(), writer.version.pk)
        body = {"model": "writer", "prompt": "hello", "max_tokens": 10}
        whole = await openai_post(writer.key_a, "/v1/completions", body)()
        streamed = await openai_post(writer.key_a, "/v1/completions", body | {"stream": True})()
        return whole, streamed

    (response, whole), (events_response, events) = run(scenario)
    assert response.status_code == 200 and whole["object"] == "text_completion"
    assert (
        whole["choices"][0]["text"] == "HELLO" and whole["choices"][0]["finish_reason"] == "length"
    )
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    assert events_response["Content-Type"] == "text/event-stream"
    lines = [line[6:] for line in events.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "HELLO"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_chat_uses_the_template_and_stops_at_the_next_user_turn(writer, state):
    async def scenario():
        agent = FakeAgent(state(), writer.version.pk)
        body = {
            "model": "writer",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            "max_tokens": 30,
        }
        answer = await openai_post(writer.key_a, "/v1/chat/completions", body)()
        return agent, answer

    agent, (response, answer) = run(scenario)
    assert response.status_code == 200 and answer["object"] == "chat.completion"
    assert agent.requests[0].prompt == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert "\n\nUser:" in agent.requests[0].stop
    assert answer["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "key_name, body, status, error_type, words",
    [
        ("bad", {"model": "writer", "prompt": "x"}, 401, "authentication_error", "invalid"),
        ("a", {"model": "writer"}, 400, "invalid_request_error", "prompt"),
        ("a", {"model": "writer", "prompt": "x", "n": 2}, 400, "invalid_request_error", "n"),
        ("a", {"model": "nope", "prompt": "x"}, 404, "invalid_request_error", "not found"),
        ("b", {"model": "writer", "prompt": "x"}, 404, "invalid_request_error", "not found"),
    ],
)
def test_openai_errors_in_openais_shape(writer, state, key_name, body, status, error_type, words):
    key = {"a": writer.key_a, "b": writer.key_b, "bad": "sy_bad_key"}[key_name]
    response, answer = run(openai_post(key, "/v1/completions", body))
    assert response.status_code == status
    assert answer["error"]["type"] == error_type and words in answer["error"]["message"]


# Priority and deadline: from the field, the header or the key, carried to the agent ----------


class ExpiringAgent(FakeAgent):
    """Answers every stream as an agent does one still waiting for a slot past its budget."""

    async def stream(self, request: GenerateRequest) -> None:
        message = f"waited 5 ms for a generation slot, past its budget of {request.budget_ms} ms"
        self.pool.deliver(self.link, error_frame(request.id, "expired", message))


def openai_with(key: str, path: str, body: dict, headers: dict):
    async def call():
        response = await AsyncClient().post(
            path,
            body,
            content_type="application/json",
            headers={"Authorization": f"Bearer {key}", **headers},
        )
        return response, response.json()

    return call


def test_openai_priority_and_timeout_travel_to_the_agent(writer, state):
    _, batch_key = make_key(writer.a, "nightly", priority=BATCH)
    body = {"model": "writer", "prompt": "hi", "max_tokens": 2}

    async def scenario():
        agent = FakeAgent(state(), writer.version.pk)
        answers = [
            await openai_with(writer.key_a, "/v1/completions", body, {})(),
            await openai_with(writer.key_a, "/v1/completions", body | {"priority": "shadow"}, {})(),
            await openai_with(
                writer.key_a,
                "/v1/chat/completions",
                {
                    "model": "writer",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                {"X-Switchyard-Priority": "batch", "X-Switchyard-Timeout-Ms": "250"},
            )(),
            await openai_with(batch_key, "/v1/completions", body, {})(),
        ]
        return agent, answers

    agent, answers = run(scenario)
    assert [response.status_code for response, _ in answers] == [200] * 4
    sent = [(r.priority, r.budget_ms) for r in agent.requests]
    assert [priority for priority, _ in sent] == [INTERACTIVE, SHADOW, BATCH, BATCH]
    server_ms = state().infer_timeout * 1000
    assert server_ms - 1000 < sent[0][1] <= server_ms  # less what admission took
    assert 0 < sent[2][1] <= 250


@pytest.mark.parametrize(
    "body_fields, headers, status, error_type, words",
    [
        ({"priority": "urgent"}, {}, 400, "invalid_request_error", "priority: must be one of"),
        ({"priority": [1]}, {}, 400, "invalid_request_error", "priority: must be one of"),
        ({}, {"X-Switchyard-Priority": "3"}, 400, "invalid_request_error", "x-switchyard-prio"),
        ({"priority": "batch"}, {"X-Switchyard-Priority": "shadow"}, 400, "invalid", "disagree"),
        ({}, {"X-Switchyard-Timeout-Ms": "-1"}, 400, "invalid_request_error", "timeout-ms"),
        ({"priority": "critical"}, {}, 403, "permission_error", "'critical' is above"),
        ({}, {"X-Switchyard-Priority": "interactive"}, 403, "permission_error", "is above"),
    ],
)
def test_openai_bad_or_forbidden_priority_in_openais_shape(
    writer, state, body_fields, headers, status, error_type, words
):
    _, batch_key = make_key(writer.a, "nightly", priority=BATCH)
    body = {"model": "writer", "prompt": "hi", "max_tokens": 2} | body_fields

    async def scenario():
        agent = FakeAgent(state(), writer.version.pk)
        return agent, await openai_with(batch_key, "/v1/completions", body, headers)()

    agent, (response, answer) = run(scenario)
    assert response.status_code == status
    assert error_type in answer["error"]["type"] and words in answer["error"]["message"]
    assert agent.requests == []  # refused before any agent heard of it


@pytest.mark.parametrize("stream", [False, True])
def test_a_stream_the_agent_drops_past_its_deadline_is_a_504_in_openais_shape(
    writer, state, stream
):
    body = {"model": "writer", "prompt": "hi", "max_tokens": 2, "stream": stream}

    async def scenario():
        ExpiringAgent(state(), writer.version.pk)
        headers = {"X-Switchyard-Timeout-Ms": "5"}
        return await openai_with(writer.key_a, "/v1/completions", body, headers)()

    response, answer = run(scenario)
    assert response.status_code == 504
    assert "past its budget of" in answer["error"]["message"]
    assert set(answer["error"]) == {"message", "type", "param", "code"}


def test_the_socket_takes_priority_and_timeout_from_the_frame_or_the_handshake(writer, state):
    _, batch_key = make_key(writer.a, "nightly", priority=BATCH)
    handshake = [(b"x-switchyard-priority", b"shadow"), (b"x-switchyard-timeout-ms", b"400")]

    async def scenario():
        agent = FakeAgent(state(), writer.version.pk)
        async with socket(writer.key_a) as ws:
            await ws.send_json_to(
                {"type": "generate", "id": "a", "prompt": "x", "priority": 3, "timeout_ms": 300}
            )
            first = await frames_until_end(ws, "a")
        async with socket(writer.key_a, headers=handshake) as ws:
            await ws.send_json_to({"type": "generate", "id": "b", "prompt": "x"})
            second = await frames_until_end(ws, "b")
        async with socket(batch_key) as ws:
            bad = []
            for frame in [
                {"type": "generate", "id": "c", "prompt": "x", "priority": "urgent"},
                {"type": "generate", "id": "d", "prompt": "x", "priority": "critical"},
                {"type": "generate", "id": "e", "prompt": "x", "timeout_ms": 0},
            ]:
                await ws.send_json_to(frame)
                bad.append(await ws.receive_json_from(timeout=5))
        return agent, first, second, bad

    agent, first, second, bad = run(scenario)
    assert first[-1]["type"] == second[-1]["type"] == "done"
    (a, b) = agent.requests
    assert a.priority == BATCH and 0 < a.budget_ms <= 300
    assert b.priority == SHADOW and 0 < b.budget_ms <= 400
    assert [(f["id"], f["code"]) for f in bad] == [
        ("c", "bad_request"),
        ("d", "forbidden"),
        ("e", "bad_request"),
    ]
    assert bad[0]["message"].startswith("priority: must be one of")
    assert bad[1]["message"].startswith("priority: 'critical' is above")
    assert bad[2]["message"].startswith("timeout_ms:")


def test_a_stream_dropped_past_its_deadline_is_a_timeout_frame_on_the_socket(writer, state):
    async def scenario():
        ExpiringAgent(state(), writer.version.pk)
        async with socket(writer.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "x", "timeout_ms": 5})
            return await frames_until_end(ws, "g")

    (error,) = run(scenario)
    assert (error["type"], error["id"], error["code"]) == ("error", "g", "timeout")
    assert "past its budget of" in error["message"]


# Budgets, in process and in Redis -------------------------------------------------------------


def budgets() -> list:
    from tenants.stream_budget import LocalStreamBudget, RedisStreamBudget

    made = [LocalStreamBudget]
    if os.environ.get("REDIS_URL"):
        prefix = f"sy:test:{os.getpid()}:{time.monotonic_ns()}:"
        made.append(lambda: RedisStreamBudget(os.environ["REDIS_URL"], prefix, ttl_s=1))
    return made


@pytest.mark.parametrize("make_budget", budgets(), ids=["local", "redis"][: len(budgets())])
def test_stream_and_token_budgets(make_budget):
    from tenants.keys import KeyIdentity
    from tenants.stream_budget import BudgetExceeded

    acme = KeyIdentity(1, 1, "acme", 100.0, 200, max_streams=2, tokens_per_minute=60)

    async def scenario():
        budget = make_budget()
        first = await budget.admit(acme, 10)
        second = await budget.admit(acme, 10)
        with pytest.raises(BudgetExceeded, match="at most 2"):
            await budget.admit(acme, 10)
        await budget.finish(acme, first, 45)  # 65 of 60 spent: the bucket is in debt
        with pytest.raises(BudgetExceeded, match="60 tokens per minute") as refused:
            await budget.admit(acme, 1)
        assert 5 <= refused.value.wait_s <= 7  # 6 tokens of debt at one token a second
        await budget.finish(acme, second, 0)
        return budget

    run(scenario)


def test_a_dead_processs_stream_slot_frees_itself_in_redis():
    if not os.environ.get("REDIS_URL"):
        pytest.skip("needs REDIS_URL")
    from tenants.keys import KeyIdentity
    from tenants.stream_budget import BudgetExceeded, RedisStreamBudget

    acme = KeyIdentity(1, 1, "acme", 100.0, 200, max_streams=1, tokens_per_minute=10_000)
    prefix = f"sy:test:{os.getpid()}:{time.monotonic_ns()}:"

    async def scenario():
        dead = RedisStreamBudget(os.environ["REDIS_URL"], prefix, ttl_s=1)
        await dead.admit(acme, 1)  # its process "dies": never finishes, never renews
        alive = RedisStreamBudget(os.environ["REDIS_URL"], prefix, ttl_s=1)
        with pytest.raises(BudgetExceeded):
            await alive.admit(acme, 1)
        await asyncio.sleep(1.2)
        assert await alive.admit(acme, 1)

    run(scenario)
