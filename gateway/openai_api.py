"""OpenAI-compatible text generation: ``POST /v1/completions`` and ``/v1/chat/completions``
(``stream: true`` as server-sent events, else one JSON answer) and ``GET /v1/models``, in
OpenAI's request and response shapes, so OpenAI client libraries work with only a base URL
(``http://HOST/v1``) and a Switchyard API key. The ``model`` is a model name of the key's
tenant; requests go through its ``production`` alias and that alias's rollout plan (``user`` is
the routing key). ``name@alias`` names another alias (``fraud@staging``, through its own plan)
and ``name@3`` a version; ``@`` cannot appear in a model name. ``GET /v1/models`` lists each
model and each of its other aliases (``name@alias``). Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import orjson
from channels.db import database_sync_to_async
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from platform_site.tokens import bearer
from registry.access import aliases_of, models_of
from serving_agent.protocol import ChatTurn, TokenChunk

from . import idempotency, spans
from .admission import authenticate, watch_key
from .errors import ApiError
from .frontdoor import Call, serve
from .generation import Chat, GenerateParams, Generation, StopString, start_generation
from .routes import DEFAULT_ALIAS
from .scheduling import PRIORITY_HEADER, TIMEOUT_HEADER, generation_schedule
from .state import GatewayState, get_state

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
# OpenAI knows "stop" and "length"; a cancelled stream has no client left to tell.
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


class _Body(BaseModel):
    # OpenAI clients send parameters we do not use (logprobs, presence_penalty, ...): ignored.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # Not OpenAI's, but vLLM's and others' (the SDK sends it through ``extra_body``).
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    seed: int | None = Field(default=None, ge=0)
    user: str | None = None
    n: Literal[1] = 1
    # Switchyard's (through ``extra_body``): the stream's priority class, which
    # ``pipeline.generation_schedule`` reads (and names in its errors).
    priority: Any = None


class CompletionBody(_Body):
    prompt: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def chat_prompt(messages: list[ChatMessage]) -> str:
    """A plain chat template: one "Role: text" paragraph per message, then the assistant's
    turn. Generation stops where the model starts the user's next turn."""
    turns = [f"{m.role.capitalize()}: {m.content.strip()}" for m in messages]
    return "\n\n".join(turns) + "\n\nAssistant:"


CHAT_STOP = "\n\nUser:"


def openai_error(
    status: int, message: str, headers: Sequence[tuple[str, str]] = ()
) -> JsonResponse:
    error_type = ERROR_TYPES.get(status, "server_error")
    body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    response = JsonResponse(body, status=status)
    for name, value in headers:
        response[name] = value
    return response


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponseBase:
    return await _serve(request, chat=False)


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    return await _serve(request, chat=True)


async def models(request: HttpRequest) -> HttpResponse:
    """The tenant's models, as ``GET /v1/models`` lists them."""
    try:
        identity = await authenticate(get_state(), request.headers.get("Authorization"))
    except ApiError as exc:
        return openai_error(exc.status, exc.message, exc.headers)

    def listing() -> list[dict[str, Any]]:
        rows = models_of(identity.tenant_id).order_by("name").values_list("name", "created_at")
        aliases = (
            aliases_of(identity.tenant_id)
            .exclude(name=DEFAULT_ALIAS)
            .order_by("model__name", "name")
            .values_list("model__name", "name", "model__created_at")
        )
        ids = [(name, created) for name, created in rows]
        ids += [(f"{model}@{alias}", created) for model, alias, created in aliases]
        return [
            {"id": ref, "object": "model", "created": int(created.timestamp()), "owned_by": ""}
            for ref, created in sorted(ids)
        ]

    return JsonResponse({"object": "list", "data": await database_sync_to_async(listing)()})


def _method_path(request: HttpRequest) -> tuple[str, str]:
    return request.method or "", request.path


# The sampled requests' spans (the generation's own span is gateway.generation's).
CHAT_DOOR = spans.HttpDoor("/v1/chat/completions", _method_path, "chat")
COMPLETIONS_DOOR = spans.HttpDoor("/v1/completions", _method_path, "text_completion")


async def _serve(request: HttpRequest, chat: bool) -> HttpResponseBase:
    state = get_state()
    call = Call(
        state,
        request.headers.get("X-Request-Id"),
        request.headers.get("traceparent"),
        CHAT_DOOR if chat else COMPLETIONS_DOOR,
        request,
    )
    # An OpenAI client reads OpenAI's error shape, never Django's HTML page.
    response = await serve(call, _answer(request, chat, state, call), _render_error)
    if call.refused is None:
        for header, value in call.trace.headers():
            response[header] = value
    call.finish()
    return response


def _render_error(exc: ApiError) -> HttpResponseBase:
    return openai_error(exc.status, exc.message, exc.headers)


async def _answer(
    request: HttpRequest, chat: bool, state: GatewayState, call: Call
) -> HttpResponseBase:
    if request.method != "POST":
        raise ApiError(405, "use POST")
    call.predicting()  # its refusals are counted, as on every door
    identity = await call.authenticate(request.headers.get("Authorization"))
    raw = _body(request)
    body, params = _parse(raw, chat)
    sched = generation_schedule(
        state,
        identity,
        body.priority,
        request.headers.get(PRIORITY_HEADER),
        request.headers.get(TIMEOUT_HEADER),
    )
    if not body.stream:  # a stream cannot be given again: its key is not used
        replay = await call.claim_key(
            identity, request.headers.get(idempotency.HEADER), "POST", request.path, raw
        )
        if replay is not None:
            return _replay(replay)
    messages = (
        Chat([ChatTurn(m.role, m.content) for m in body.messages], CHAT_STOP)
        if isinstance(body, ChatBody)
        else None
    )
    # A cold start holds here; a client that leaves meanwhile cancels this task, and the
    # lifecycle releases the Idempotency-Key so its retry generates.
    generation = await start_generation(
        state,
        identity,
        body.model,
        params,
        body.user,
        request.headers.get("X-Request-Id"),
        chat=messages,
        sched=sched,
        door="openai.chat" if chat else "openai.completions",
    )
    shape = _Shape(chat, body.model)
    response: HttpResponseBase
    if body.stream:
        # The first frame is awaited before the 200 goes out: an agent that sheds the stream
        # (overloaded, queue full, deadline) answers then, and the client must get that as
        # OpenAI's error with its status and Retry-After, not as an event in a 200 stream.
        chunks = generation.chunks()
        try:
            first = await anext(chunks, None)
        except BaseException:
            await generation.close()
            raise
        raw_key = bearer(request.headers.get("Authorization"))
        assert raw_key is not None  # it authenticated
        response = StreamingHttpResponse(
            _events(generation, chunks, first, shape, raw_key), content_type="text/event-stream"
        )
        response["Cache-Control"] = "no-cache"
    else:
        response = JsonResponse(shape.whole(await _collect(generation), generation))
    response["x-switchyard-version"] = str(generation.routed.route.version)
    if generation.routed.arm:
        response["x-switchyard-arm"] = generation.routed.arm
    kept = [(h, response[h]) for h in ("x-switchyard-version", "x-switchyard-arm") if h in response]
    if not body.stream:
        for name, value in await call.keep(response.status_code, kept, response.content):
            response[name] = value  # kept's own again, and Idempotency-Stored when not kept
    return response


def _replay(stored: idempotency.Stored) -> HttpResponse:
    """The first answer to a request sent again with its Idempotency-Key."""
    response = HttpResponse(stored.body, status=stored.status, content_type="application/json")
    for name, value in [*stored.headers, idempotency.REPLAYED]:
        response[name] = value
    return response


def _body(request: HttpRequest) -> bytes:
    try:
        return request.body
    except RequestDataTooBig:
        raise ApiError(413, "the body is larger than the server accepts") from None


def _parse(raw: bytes, chat: bool) -> tuple[_Body, GenerateParams]:
    try:
        # orjson, not the stdlib: it refuses nesting past its depth limit (the stdlib's parser
        # recurses until RecursionError), lone surrogates and NaN, none of which a prompt or a
        # sampling parameter can use.
        data = orjson.loads(raw or b"null")
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    try:
        body: ChatBody | CompletionBody = (
            ChatBody.model_validate(data) if chat else CompletionBody.model_validate(data)
        )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if isinstance(body, ChatBody):
            prompt = chat_prompt(body.messages)
            max_tokens = body.max_completion_tokens or body.max_tokens or 128
        else:
            prompt, max_tokens = body.prompt, body.max_tokens or 16  # OpenAI's default
        params = GenerateParams(
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=stop,
            seed=body.seed,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}") from None
    return body, params


async def _collect(generation: Generation) -> str:
    try:
        return "".join([chunk.text async for chunk in generation.chunks()])
    finally:
        await generation.close()


async def _events(
    generation: Generation,
    chunks: AsyncIterator[TokenChunk],
    head: TokenChunk | None,
    shape: _Shape,
    raw_key: str,
) -> AsyncIterator[str]:
    """Server-sent events, from the first chunk (``head``, already received; None when the
    stream ended without one) on; a client that disconnects cancels the stream at the agent.
    An error once the 200 is sent can only be an event (OpenAI does the same): so is a key
    revoked while the stream runs, re-checked as the websocket's is (``admission.watch_key``),
    which then cancels the stream at the agent."""
    watch = asyncio.create_task(_end_when_key_lapses(generation, raw_key))
    try:
        first = True
        if head is not None:
            yield _sse(shape.chunk(head.text, None, first))
            first = False
            async for chunk in chunks:
                yield _sse(shape.chunk(chunk.text, None, first))
        yield _sse(shape.chunk("", FINISH.get(generation.finish_reason or "stop"), first))
    except ApiError as exc:
        error = {"message": exc.message, "type": ERROR_TYPES.get(exc.status, "server_error")}
        yield _sse({"error": error | {"param": None, "code": None}})
    finally:
        watch.cancel()
        await generation.close()
    yield "data: [DONE]\n\n"


async def _end_when_key_lapses(generation: Generation, raw_key: str) -> None:
    generation.fail(await watch_key(generation.state, raw_key))


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Shape:
    """OpenAI's response objects, for completions or chat."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            if finish is not None:
                delta = {} if not first else delta
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return self._envelope("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion") | {"choices": [choice]}

    def whole(self, text: str, generation: Generation) -> dict[str, Any]:
        finish = FINISH.get(generation.finish_reason or "stop")
        usage = generation.usage
        counts = {
            "prompt_tokens": usage.input_tokens,
            "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
        }
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return self._envelope("chat.completion") | {"choices": [choice], "usage": counts}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion") | {"choices": [choice], "usage": counts}
