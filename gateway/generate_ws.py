"""The client websocket for text generation: ``/ws/v1/models/{name}/generate``.

``{name}`` alone goes through the model's ``production`` alias (and its rollout plan);
``{name}@{alias}`` (``/ws/v1/models/chat@staging/generate``) through another alias and its
plan, ``{name}@{number}`` to one version.

Authenticate with ``Authorization: Bearer <key>`` on the handshake, or a first message
``{"type": "auth", "api_key": "sy_..."}`` (the web UI's playground uses the signed-in session,
same-origin only). Then, any number of times, possibly at once:

    → {"type": "generate", "id": "g1", "prompt": "...", "max_tokens": 64, "temperature": 0.8,
       "top_p": 0.95, "stop": ["\\n\\n"], "seed": 7, "routing_key": "user-42",
       "priority": "batch", "timeout_ms": 2000}
    ← {"type": "token", "id": "g1", "text": "...", "tokens": 2}        (one or more)
    ← {"type": "done", "id": "g1", "finish_reason": "length", "model": "...", "version": 3,
       "arm": "candidate", "usage": {"input_tokens", "output_tokens", "ttft_ms",
       "tokens_per_second", "total_ms"}}
    → {"type": "cancel", "id": "g1"}                                  (optional)

``priority`` (a class name: critical, interactive, batch, shadow; or 1 best .. 4) orders the
streams waiting for a slot on the agent; ``timeout_ms`` bounds that wait (a stream still
waiting then gets a ``timeout`` error). The handshake's ``X-Switchyard-Priority`` and
``X-Switchyard-Timeout-Ms`` headers set them for every generation on the socket. Without them,
the key's priority and the server's timeout; a class above the key's is ``forbidden``.

A problem is an error frame ``{"type": "error", "id": ..., "code": ..., "message": ...}``; the
socket stays open except for a bad key (closed 4401) and a client too slow to read its tokens
(closed 4408). Closing the socket cancels every generation on it at the agent.

A key is checked again on every ``generate`` frame and every ``SWITCHYARD_STREAM_KEY_RECHECK_S``
while the socket is open (``admission.recheck_key``, as OpenAI's server-sent events are): once
it is revoked or expired, each running generation gets an error frame (``unauthorized``), is
cancelled at the agent, and the socket is closed 4401.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import orjson
from channels.generic.websocket import AsyncWebsocketConsumer
from pydantic import Field, ValidationError

from platform_site.origins import same_origin
from platform_site.tokens import bearer
from tenants.keys import KeyIdentity
from tenants.members import session_identity

from . import spans
from .admission import recheck_key, watch_key
from .db import db_call
from .dispatch import SlowClient
from .errors import ApiError
from .frontdoor import Call, serve
from .generation import GenerateParams, start_generation
from .scheduling import PRIORITY_HEADER, TIMEOUT_HEADER, Schedule, generation_schedule
from .state import get_state

log = logging.getLogger(__name__)

# Each generation's span when sampled (its socket's path read from the consumer's scope).
DOOR = spans.StreamDoor("/ws/v1/models/{name}/generate", lambda consumer: consumer.scope["path"])
CLOSE_UNAUTHORIZED = 4401
CLOSE_SLOW_CLIENT = 4408
MAX_MESSAGE_BYTES = 1_048_576
CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    429: "rate_limited",
    502: "agent_failed",
    503: "unavailable",
    504: "timeout",
}


class GenerateRequestMessage(GenerateParams):
    type: str
    id: str | None = None
    routing_key: str | None = None
    priority: Any = None  # read by pipeline.generation_schedule, which names it in its errors
    timeout_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class GenerateConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        self.model_name: str = self.scope["url_route"]["kwargs"]["name"]
        self.state = get_state()
        self.identity: KeyIdentity | None = None
        self.raw_key: str | None = None  # set when a key (not a session) authenticated
        self.recheck: asyncio.Task[None] | None = None
        self.revoked = False
        self.running: dict[str, asyncio.Task[None]] = {}
        await self.accept()
        headers = dict(self.scope.get("headers") or [])
        # The handshake's scheduling headers: defaults for every generation on the socket.
        self.priority_header = _latin1(headers.get(PRIORITY_HEADER.encode()))
        self.timeout_header = _latin1(headers.get(TIMEOUT_HEADER.encode()))
        # The handshake's trace context: each generation on the socket is a child of it.
        self.traceparent = _latin1(headers.get(b"traceparent"))
        authorization = headers.get(b"authorization")
        user = self.scope.get("user")
        if authorization is not None:
            await self._authenticate(authorization.decode("latin-1"))
        elif user is not None and user.is_authenticated and same_origin(self.scope):
            self.identity = await db_call(session_identity)(user, self.scope["session"])

    async def disconnect(self, code: int) -> None:
        if self.recheck is not None:
            self.recheck.cancel()
        for task in self.running.values():
            task.cancel()  # each task's ``finally`` cancels its stream at the agent
        await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if text_data is None or len(text_data) > MAX_MESSAGE_BYTES:
            await self.refuse(None, ApiError(400, "send JSON text frames of at most 1 MiB"))
            return
        try:
            # orjson: it refuses nesting past its depth limit, where the stdlib's parser
            # recurses until RecursionError and the socket would close with 1011.
            message = orjson.loads(text_data)
        except orjson.JSONDecodeError as exc:
            await self.refuse(None, ApiError(400, f"malformed JSON: {exc}"))
            return
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "auth":
            await self._authenticate(f"Bearer {message.get('api_key') or ''}")
        elif self.identity is None:
            await self.refuse(
                message.get("id") if kind else None, ApiError(401, "authenticate first")
            )
            await self.close(CLOSE_UNAUTHORIZED)
        elif kind == "generate":
            if await self._key_still_valid():
                await self._generate(message)
        elif kind == "cancel":
            task = self.running.get(str(message.get("id")))
            if task is not None:
                task.cancel()
        else:
            await self.refuse(None, ApiError(400, 'type: expected "auth", "generate" or "cancel"'))

    async def _authenticate(self, authorization: str) -> None:
        call = Call(self.state, None, None)
        call.predicting()  # a refused key is counted, as on every door
        identity = await serve(call, call.authenticate(authorization), _as_error)
        call.finish()
        if isinstance(identity, ApiError):
            await self.error(None, identity.status, identity.message)
            await self.close(CLOSE_UNAUTHORIZED)
            return
        self.identity = identity
        self.raw_key = bearer(authorization)
        if self.recheck is None:
            self.recheck = asyncio.create_task(self._recheck_key())

    async def _key_still_valid(self) -> bool:
        """Whether the socket's key is still active (always, for a signed-in session); if not,
        the socket is ended (``_key_lapsed``)."""
        if self.raw_key is None:
            return True
        try:
            identity = await recheck_key(self.state, self.raw_key)
        except ApiError as exc:
            await self._key_lapsed(exc)
            return False
        if identity is not None:
            self.identity = identity  # a changed priority or limit applies from now on
        return True

    async def _recheck_key(self) -> None:
        """Re-check the key while the socket is open, so that a long stream does not outlive
        its key (``admission.watch_key``)."""
        assert self.raw_key is not None  # started once a key authenticated
        await self._key_lapsed(await watch_key(self.state, self.raw_key))

    async def _key_lapsed(self, why: ApiError) -> None:
        """A revoked or expired key ends every generation on the socket and closes it."""
        if self.revoked:
            return  # the other check saw it first
        self.raw_key = None
        self.revoked = True
        for stream_id, task in list(self.running.items()):
            task.cancel()
            await self.error(stream_id, why.status, why.message)
        await self.error(None, why.status, why.message)
        await self.close(CLOSE_UNAUTHORIZED)

    async def _generate(self, message: dict[str, Any]) -> None:
        try:
            request = GenerateRequestMessage.model_validate(message)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "request"
            await self.refuse(message.get("id"), ApiError(400, f"{where}: {first['msg']}"))
            return
        stream_id = request.id or uuid.uuid4().hex[:12]
        if stream_id in self.running:
            await self.refuse(
                stream_id, ApiError(400, f"id: generation {stream_id!r} is still running")
            )
            return
        assert self.identity is not None  # receive() starts generations once authenticated
        try:
            sched = generation_schedule(
                self.state,
                self.identity,
                request.priority,
                self.priority_header,
                self.timeout_header,
            )
        except ApiError as exc:
            await self.refuse(stream_id, exc)
            return
        if request.timeout_ms is not None:
            sched = Schedule(sched.priority, min(sched.budget_ms, request.timeout_ms))
        # The message is a GenerateParams with its envelope fields: already validated.
        task = asyncio.create_task(self._run(stream_id, request, request.routing_key, sched))
        self.running[stream_id] = task
        task.add_done_callback(lambda _t: self.running.pop(stream_id, None))

    async def _run(
        self, stream_id: str, params: GenerateParams, routing_key: str | None, sched: Schedule
    ) -> None:
        """One generation under the front-door lifecycle: its trace, its refusals counted,
        every error (expected or not) an error frame."""
        assert self.identity is not None  # receive() starts generations once authenticated
        call = Call(self.state, None, self.traceparent, DOOR, self)
        call.predicting()
        call.observed.tenant = self.identity.tenant_slug
        error = await serve(call, self._stream(stream_id, params, routing_key, sched), _as_error)
        call.finish()
        if error is not None:
            await self.error(stream_id, error.status, error.message)

    async def _stream(
        self, stream_id: str, params: GenerateParams, routing_key: str | None, sched: Schedule
    ) -> ApiError | None:
        assert self.identity is not None
        generation = None
        try:

            async def loading(progress: dict[str, Any]) -> None:
                await self.send_json({"type": "loading", "id": stream_id, **progress})

            generation = await start_generation(
                self.state,
                self.identity,
                self.model_name,
                params,
                routing_key,
                stream_id,
                loading,
                sched=sched,
            )
            async for chunk in generation.chunks():
                await self.send_json(
                    {"type": "token", "id": stream_id, "text": chunk.text, "tokens": chunk.tokens}
                )
            await generation.close()  # budgets settled before the client hears it is done
            route = generation.routed.route
            await self.send_json(
                {
                    "type": "done",
                    "id": stream_id,
                    "finish_reason": generation.finish_reason,
                    "model": route.model_name,
                    "version": route.version,
                    "arm": generation.routed.arm,
                    "usage": generation.usage.as_dict(),
                }
            )
        except SlowClient as exc:
            await self.error(stream_id, 429, exc.message)
            await self.close(CLOSE_SLOW_CLIENT)
        except asyncio.CancelledError:
            # A revocation has told the client already, with an error frame.
            if generation is not None and generation.finish_reason is None and not self.revoked:
                await self._send_quietly(
                    {"type": "done", "id": stream_id, "finish_reason": "cancelled"}
                )
            raise
        finally:
            if generation is not None:
                await generation.close()
        return None

    async def refuse(self, stream_id: object, exc: ApiError) -> None:
        """A request refused before its generation started: counted by the front-door
        lifecycle as every door's refusals are, then told as an error frame."""
        call = Call(self.state, None, self.traceparent, DOOR, self)
        call.predicting()
        if self.identity is not None:
            call.observed.tenant = self.identity.tenant_slug
        call.status = exc.status
        call.finish()
        await self.error(stream_id, exc.status, exc.message)

    async def error(self, stream_id: object, status: int, message: str) -> None:
        """An error frame; ``stream_id`` as the client sent it, which is echoed only if it is
        a string (an id that is a list or an object names no generation)."""
        frame = {
            "type": "error",
            "id": stream_id if isinstance(stream_id, str) else None,
            "code": CODES.get(status, "internal"),
        }
        await self._send_quietly(frame | {"message": message})

    async def send_json(self, payload: dict[str, Any]) -> None:
        # orjson: a token's message is sent for every chunk, and it is ~5x the stdlib's speed.
        await self.send(text_data=orjson.dumps(payload).decode())

    async def _send_quietly(self, payload: dict[str, Any]) -> None:
        try:
            await self.send_json(payload)
        except Exception:  # the socket is gone: nobody is left to tell
            log.debug("could not send %s on a closed socket", payload.get("type"))


def _as_error(exc: ApiError) -> ApiError:
    """The socket renders an error as an error frame (``GenerateConsumer.error``), which is
    sent once the lifecycle has counted it."""
    return exc


def _latin1(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")
