"""Text generation on the data path: admit a stream (the tenant's stream and token budgets, the
version's token limits, the rollout plan), hand it to an agent, and relay its frames.

Both front doors use this: the Channels websocket (``gateway/generate_ws.py``) and the
OpenAI-compatible HTTP API (``gateway/openai_api.py``). The tenant's budgets are shared by all
gateway processes through Redis (in process on the embedded default): ``tenants.stream_budget``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from serving_agent.protocol import GenerateDone, GenerateRequest, TokenChunk
from tenants.keys import KeyIdentity
from tenants.ratelimit import retry_after_header
from tenants.stream_budget import RENEW_S, BudgetExceeded

from . import metrics, tracing
from .dispatch import DispatchError, SlowClient, StreamInbox
from .pipeline import (
    ApiError,
    Routed,
    hold_in_flight,
    release_in_flight,
    resolve,
    route_request,
)
from .state import GatewayState, Progress

StopString = Annotated[str, Field(min_length=1, max_length=64)]


class GenerateParams(BaseModel):
    """What a client may ask of one generation (validated at both front doors)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=1_000_000)
    max_tokens: int = Field(default=64, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[StopString] = Field(default_factory=list, max_length=4)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)


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
    ) -> None:
        self.state = state
        self.identity = identity
        self.routed = routed
        self.stream = stream
        self.started = started
        self.slot = slot  # the tenant's stream slot, renewed while the stream runs
        self._renewed = time.monotonic()
        self.usage = TokenUsage(input_tokens=prompt_tokens)
        self.finish_reason: str | None = None
        self._closed = False

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
                raise ApiError(exc.status, exc.message, _retry(exc)) from None
            elapsed_ms = (time.perf_counter() - self.started) * 1000
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
            self.usage.output_tokens += frame.tokens
            if time.monotonic() - self._renewed > RENEW_S:
                self._renewed = time.monotonic()
                await self.state.streams.renew(self.identity, self.slot)
            yield frame

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            await self.stream.cancel()
        self.state.pool.close_stream(self.stream)
        release_in_flight(self.state, self.identity)
        await self.state.streams.finish(self.identity, self.slot, self.usage.output_tokens)

    def _record(self, ok: bool) -> None:
        # Guardrails compare arms on time to first token: what a streaming client waits for.
        waited = self.usage.ttft_ms if self.usage.ttft_ms is not None else 0.0
        self.state.traffic.record(self.routed.route.version_id, waited / 1000, ok)

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
) -> Generation:
    """Resolve the model (through its rollout plan), check every limit, start the stream. The
    stream counts against its key's in-flight limit until ``Generation.close``."""
    hold_in_flight(state, identity)
    try:
        return await _start(
            state, identity, model_name, params, routing_key, request_id, on_loading
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
) -> Generation:
    started = time.perf_counter()
    route = await resolve(state, identity, model_name, None)
    routed = await route_request(
        state, identity, route, False, lambda _header: routing_key, request_id
    )
    route = routed.route
    if not route.generates_text:
        raise ApiError(
            400, f"model {model_name!r} does not generate text: use /v2/models/{model_name}/infer"
        )
    prompt_tokens = count_tokens(params.prompt)
    if prompt_tokens > route.max_input_tokens:
        raise ApiError(
            400,
            f"prompt: {prompt_tokens} tokens; version {route.version} of {model_name!r} takes "
            f"at most {route.max_input_tokens}",
        )
    if params.max_tokens > route.max_output_tokens:
        raise ApiError(
            400,
            f"max_tokens: {params.max_tokens}; version {route.version} of {model_name!r} "
            f"generates at most {route.max_output_tokens}",
        )
    try:
        # A cold start holds here, before the tenant's stream budget is taken, and tells a
        # streaming client how loading goes.
        await state.ready(route.version_id, on_loading)
    except DispatchError as exc:
        raise ApiError(exc.status, exc.message, _retry(exc)) from None
    try:
        slot = await state.streams.admit(identity, prompt_tokens)
    except BudgetExceeded as exc:
        raise ApiError(429, str(exc), [("Retry-After", retry_after_header(exc.wait_s))]) from None
    request = GenerateRequest(
        id=0,  # numbered by the pool
        version_id=route.version_id,
        prompt=params.prompt,
        max_new_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        stop=params.stop,
        seed=params.seed,
        trace=(tracing.current.get() or tracing.start_trace(None, None)).traceparent,
    )
    try:
        stream = await state.pool.open_stream(request)
    except DispatchError as exc:
        await state.streams.finish(identity, slot, 0)
        raise ApiError(exc.status, exc.message, _retry(exc)) from None
    return Generation(state, identity, routed, stream, started, prompt_tokens, slot)
