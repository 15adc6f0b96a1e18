"""Text generation on the data path: admit a stream (the tenant's stream and token budgets, the
version's token limits, the rollout plan), hand it to an agent, and relay its frames.

Both front doors use this: the Channels websocket (``gateway/generate_ws.py``) and the
OpenAI-compatible HTTP API (``gateway/openai_api.py``). The tenant's budgets are shared by all
gateway processes through Redis (in process on the embedded default): ``tenants.stream_budget``.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from serving_agent.protocol import ChatTurn, GenerateDone, GenerateRequest, TokenChunk
from tenants.keys import KeyIdentity
from tenants.ratelimit import retry_after_header
from tenants.stream_budget import RENEW_S, BudgetExceeded

from . import genlog, metrics, spans, tracing
from .admission import check_budget, hold_in_flight, model_ref, release_in_flight, resolve
from .arms import Routed, route_request
from .dispatch import DispatchError, SlowClient, StreamInbox
from .errors import ApiError
from .scheduling import Schedule, default_schedule
from .state import GatewayState, Progress

StopString = Annotated[str, Field(min_length=1, max_length=64)]


class GenerateParams(BaseModel):
    """What a client may ask of one generation (validated at both front doors)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=1_000_000)
    max_tokens: int = Field(default=64, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000)  # 0: no cut
    stop: list[StopString] = Field(default_factory=list, max_length=4)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)


@dataclass(frozen=True)
class Chat:
    """A chat request's messages. ``GenerateParams.prompt`` holds them in the platform's plain
    format (with ``stop``, where the model would start the user's next turn) for versions
    without a tokenizer of their own; an ``hf`` version's agent renders them with the model's
    chat template instead."""

    messages: list[ChatTurn]
    stop: str


def count_tokens(text: str) -> int:
    """Prompt tokens as the served architecture counts them: it is byte-level (UTF-8 bytes)."""
    return len(text.encode("utf-8"))


@dataclass
class TokenUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None  # at the gateway: from admission to the first token
    total_ms: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed after the first token, as the client sees it."""
        decode_s = (self.total_ms - (self.ttft_ms or 0.0)) / 1000
        return round((self.output_tokens - 1) / decode_s, 2) if decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | None]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 2),
            "tokens_per_second": self.tokens_per_second,
            "total_ms": round(self.total_ms, 2),
        }


class Generation:
    """One admitted stream. Iterate for ``TokenChunk`` frames; afterwards ``finish_reason``
    and ``usage`` are set. ``close`` (always, e.g. in ``finally``) cancels an unfinished
    stream at the agent and gives back the tenant's stream slot."""

    def __init__(
        self,
        state: GatewayState,
        identity: KeyIdentity,
        routed: Routed,
        stream: StreamInbox,
        started: float,
        prompt_tokens: int,
        slot: str,
        charged: int | None = None,
        params: GenerateParams | None = None,
        door: str = "websocket",
    ) -> None:
        self.state = state
        self.identity = identity
        self.routed = routed
        self.stream = stream
        self.started = started
        self.slot = slot  # the tenant's stream slot, renewed while the stream runs
        self._renewed = time.monotonic()
        self.usage = TokenUsage(input_tokens=prompt_tokens)
        # What admission charged the tenant's budget for the prompt; the agent's real count
        # is charged on top at the end where it was not known then (hf versions).
        self.charged = prompt_tokens if charged is None else charged
        self.finish_reason: str | None = None
        self._closed = False
        # Counted here per token, folded into the histogram when the stream closes.
        self._itl = metrics.LocalHistogram(metrics.ITL_BUCKETS_S)
        self._last_chunk = 0.0  # perf_counter() when the previous chunk arrived
        self.status = 200  # an agent's refusal mid-stream sets its status
        self.params, self.door = params, door
        self.trace = tracing.current.get()
        # The generation log's sample, decided now: an unsampled stream keeps no text.
        route = routed.route
        sampled = (
            params is not None
            and state.log_predictions
            and route.log_sample_rate > 0
            and random.random() < route.log_sample_rate
        )
        self._texts: list[str] | None = [] if sampled else None
        self._kept = 0  # characters kept in _texts, which stops at what the log takes

    async def chunks(self) -> AsyncIterator[TokenChunk]:
        timeout = self.state.infer_timeout
        while True:
            try:
                frame = await self.stream.next(timeout)
            except SlowClient:
                self._record(ok=True)  # the client's doing, not the version's
                raise
            except DispatchError as exc:
                self._record(ok=exc.status < 500)
                self.status = exc.status
                raise ApiError(exc.status, exc.message, _retry(exc)) from None
            now = time.perf_counter()
            elapsed_ms = (now - self.started) * 1000
            if isinstance(frame, GenerateDone):
                self.finish_reason = frame.finish_reason
                self.usage.input_tokens = frame.input_tokens
                self.usage.output_tokens = frame.output_tokens
                self.usage.total_ms = elapsed_ms
                self._record(ok=True)
                self._observe()
                return
            if self.usage.ttft_ms is None:
                self.usage.ttft_ms = elapsed_ms
            elif frame.tokens:
                # A chunk of several tokens (merged while the reader was busy): its wait split
                # evenly among them.
                self._itl.observe((now - self._last_chunk) / frame.tokens, frame.tokens)
            self._last_chunk = now
            self.usage.output_tokens += frame.tokens
            if self._texts is not None and self._kept <= genlog.MAX_LOGGED_CHARS:
                self._texts.append(frame.text)
                self._kept += len(frame.text)
            if time.monotonic() - self._renewed > RENEW_S:
                self._renewed = time.monotonic()
                await self.state.streams.renew(self.identity, self.slot)
            yield frame

    def fail(self, error: ApiError) -> None:
        """End the stream from this side: ``chunks`` raises ``error`` once the reader has
        taken what already arrived (its key was revoked while it ran)."""
        self.status = error.status
        self.stream.fail(DispatchError(error.status, error.message))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        route = self.routed.route
        # The records first: the awaits below may be cut short (a client's socket closing
        # cancels its tasks again), and what the stream was is known by now.
        if self._texts is not None:
            self._log()
        if self.trace is not None and self.trace.sampled:  # its span (gateway.spans)
            spans.export_generation(
                self.trace,
                operation="chat" if self.door == "openai.chat" else "text_completion",
                route=route,
                tenant=self.identity.tenant_slug,
                arm=self.routed.arm,
                started=self.started,
                input_tokens=self.usage.input_tokens,
                output_tokens=self.usage.output_tokens,
                ttft_ms=self.usage.ttft_ms,
                finish_reason=self.finish_reason,
                status=self.status,
            )
        labels = (self.identity.tenant_slug, route.model_name, str(route.version))
        self._itl.fold_into(metrics.ITL.labels(*labels))
        if self.finish_reason is None:
            await self.stream.cancel()
        self.state.pool.close_stream(self.stream)
        release_in_flight(self.state, self.identity)
        # Usage: the prompt (the agent's count once done) and the tokens the client was sent.
        self.state.traffic.tokens(
            route.version_id, self.usage.input_tokens, self.usage.output_tokens, self.routed.counted
        )
        uncharged = max(0, self.usage.input_tokens - self.charged)
        await self.state.streams.finish(
            self.identity, self.slot, self.usage.output_tokens + uncharged
        )

    def _log(self) -> None:
        """Offer the sampled stream to the generation log (never blocks)."""
        assert self._texts is not None and self.params is not None
        if self.finish_reason is not None:
            finish = self.finish_reason
        else:
            finish = "error" if self.status != 200 else "cancelled"
        trace = self.trace
        params = self.params.model_dump(exclude={"prompt"})
        self.state.genlog.offer_generation(
            genlog.sample_of(
                self.routed.route,
                arm=self.routed.arm,
                door=self.door,
                request_id=trace.request_id if trace else "",
                trace_id=trace.trace_id if trace else "",
                prompt=self.params.prompt,
                completion="".join(self._texts),
                params=params,
                input_tokens=self.usage.input_tokens,
                output_tokens=self.usage.output_tokens,
                finish_reason=finish,
                status=self.status,
                ttft_ms=self.usage.ttft_ms,
                total_ms=self.usage.total_ms or (time.perf_counter() - self.started) * 1000,
            )
        )

    def _record(self, ok: bool) -> None:
        # Guardrails compare arms on time to first token: what a streaming client waits for.
        waited = self.usage.ttft_ms if self.usage.ttft_ms is not None else 0.0
        self.state.traffic.record(
            self.routed.route.version_id, waited / 1000, ok, self.routed.counted
        )

    def _observe(self) -> None:
        route = self.routed.route
        labels = (self.identity.tenant_slug, route.model_name, str(route.version))
        if self.usage.ttft_ms is not None:
            metrics.TTFT.labels(*labels).observe(self.usage.ttft_ms / 1000)
        if self.usage.output_tokens > 1:
            metrics.TOKEN_RATE.labels(*labels).observe(self.usage.tokens_per_second)
        metrics.TOKENS.labels(*labels).inc(self.usage.output_tokens)


def _retry(exc: DispatchError) -> list[tuple[str, str]]:
    return [("Retry-After", str(exc.retry_after))] if exc.retry_after else []


async def start_generation(
    state: GatewayState,
    identity: KeyIdentity,
    model_name: str,
    params: GenerateParams,
    routing_key: str | None = None,
    request_id: str | None = None,
    on_loading: Progress | None = None,
    chat: Chat | None = None,
    sched: Schedule | None = None,
    door: str = "websocket",
) -> Generation:
    """Resolve the model (through its rollout plan), check every limit, start the stream. The
    stream counts against its key's in-flight limit until ``Generation.close``. ``sched``
    (``pipeline.generation_schedule``; the key's default without) travels to the agent: its
    class orders the streams waiting for a slot, its budget bounds that wait."""
    hold_in_flight(state, identity)
    try:
        return await _start(
            state,
            identity,
            model_name,
            params,
            routing_key,
            request_id,
            on_loading,
            chat,
            sched or default_schedule(state, identity),
            door,
        )
    except BaseException:
        release_in_flight(state, identity)
        raise


async def _start(
    state: GatewayState,
    identity: KeyIdentity,
    model_name: str,
    params: GenerateParams,
    routing_key: str | None,
    request_id: str | None,
    on_loading: Progress | None,
    chat: Chat | None,
    sched: Schedule,
    door: str,
) -> Generation:
    started = time.perf_counter()
    check_budget(state, identity)
    # ``model_name`` may name an alias or a version: ``name@staging``, ``name@3``.
    name, version = model_ref(model_name)
    route = await resolve(state, identity, name, version)
    routed = await route_request(state, identity, route, lambda _header: routing_key, request_id)
    route = routed.route
    if not route.generates_text:
        raise ApiError(400, f"model {name!r} does not generate text: use /v2/models/{name}/infer")
    # A format whose agent tokenizes (hf, registry.formats) has the real tokenizer there: the
    # agent counts the prompt, refuses one past max_input_tokens, renders a chat with the
    # model's template and reports the count, which the tenant's budget is charged at the end.
    # The byte-level model's tokens are bytes, counted here.
    own_tokenizer = route.tokenizes_on_agent
    prompt_tokens = 0 if own_tokenizer else count_tokens(params.prompt)
    if prompt_tokens > route.max_input_tokens:
        raise ApiError(
            400,
            f"prompt: {prompt_tokens} tokens; version {route.version} of {name!r} takes "
            f"at most {route.max_input_tokens}",
        )
    if params.max_tokens > route.max_output_tokens:
        raise ApiError(
            400,
            f"max_tokens: {params.max_tokens}; version {route.version} of {name!r} "
            f"generates at most {route.max_output_tokens}",
        )
    try:
        # A cold start holds here, before the tenant's stream budget is taken, and tells a
        # streaming client how loading goes.
        await state.ready(route.version_id, on_loading, route, identity.tenant_slug)
    except DispatchError as exc:
        raise ApiError(exc.status, exc.message, _retry(exc)) from None
    try:
        slot = await state.streams.admit(identity, prompt_tokens)
    except BudgetExceeded as exc:
        raise ApiError(429, str(exc), [("Retry-After", retry_after_header(exc.wait_s))]) from None
    stop, messages = params.stop, []
    if chat is not None and own_tokenizer:
        messages = chat.messages
    elif chat is not None:
        stop = [*stop, chat.stop][:4]
    request = GenerateRequest(
        id=0,  # numbered by the pool
        version_id=route.version_id,
        prompt=params.prompt,
        messages=messages,
        max_new_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=stop,
        seed=params.seed,
        trace=(tracing.current.get() or tracing.start_trace(None, None)).traceparent,
        priority=sched.priority,
        # What is left of it after a cold start: the wait for the agent counted too.
        budget_ms=max(0.0, sched.budget_ms - (time.perf_counter() - started) * 1000),
    )
    try:
        stream = await state.pool.open_stream(request)
    except DispatchError as exc:
        await state.streams.finish(identity, slot, 0)
        raise ApiError(exc.status, exc.message, _retry(exc)) from None
    return Generation(
        state, identity, routed, stream, started, prompt_tokens, slot, params=params, door=door
    )
