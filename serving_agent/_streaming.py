"""What every generation engine shares, without torch: the interface the agent drives an engine
through (``GenerationEngine``), the stop-string rules, the plain chat prompt and how one step's
output becomes each connection's frames.

Two engines implement it: ``_generate.Engine`` (the built-in decoder and Hugging Face models,
on torch) and ``_python_engine.PythonEngine`` (a ``python_generator`` package's generators, in
a sandboxed worker). Only nodes serving a torch format import torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Protocol

from . import telemetry
from ._batcher import SchedCounts
from ._compute import ComputeMeter, RunTotals
from ._generation_stats import GenerationStats
from .protocol import (
    PRIORITY_CLASSES,
    ChatTurn,
    GenerateDone,
    GenerateRequest,
    GenerationLimits,
    TokenBatch,
    TokenChunk,
    encode_frame,
)

logger = logging.getLogger(__name__)

MAX_STOPS = 16
MAX_STOP_CHARS = 256

# Sends one step's frames to the connection a stream came from. The agent drops them if that
# connection is gone, so a stream never answers on a later connection.
SendFrames = Callable[[list[bytes]], Awaitable[None]]


class GenerationEngine(Protocol):
    """What the agent asks of a loaded generative version (``_versions.LoadedTextGen``)."""

    provider: str
    stats: GenerationStats
    counts: SchedCounts  # the agent shares one across its versions
    meter: ComputeMeter
    totals: RunTotals

    @property
    def streams_active(self) -> int: ...

    def set_limits(self, limits: GenerationLimits | None) -> None: ...

    def submit(
        self, request: GenerateRequest, send: SendFrames, received: float | None = None
    ) -> None:
        """Start a stream, or raise the error its request gets (``AgentError``s)."""
        ...

    def cancel(self, request_id: int) -> None: ...

    def cancel_all(self, senders: Collection[SendFrames] | None = None) -> None: ...

    async def stop(self) -> None: ...

    def outside_bytes(self) -> int:
        """Memory the version holds outside the agent's process (a python package's worker),
        for its footprint."""
        ...


class Sends(Protocol):
    """A stream, as far as sending its frames goes."""

    @property
    def send(self) -> SendFrames: ...


def plain_chat_prompt(messages: Sequence[ChatTurn]) -> str:
    """The chat format of a model without a template: one "role: content" line per message,
    then the assistant's turn."""
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest stop string begins in ``text`` (searching from about ``start``)."""
    found = [i for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(found) if found else None


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters might begin a stop string, so must not be sent yet."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


def frames_by_sender(
    out: Sequence[tuple[Sends, TokenChunk | bytes]],
) -> dict[SendFrames, list[bytes]]:
    """One step's output as the frames for each connection: first one ``TokenBatch`` with every
    stream's new text (a stream's chunk comes before its done frame, which follows), then the
    other frames in the order the step made them."""
    chunks: dict[SendFrames, list[TokenChunk]] = {}
    frames: dict[SendFrames, list[bytes]] = {}
    for stream, item in out:
        if isinstance(item, TokenChunk):
            chunks.setdefault(stream.send, []).append(item)
        else:
            frames.setdefault(stream.send, []).append(item)
    for send, texts in chunks.items():
        frames[send] = [encode_frame(TokenBatch(texts)), *frames.get(send, ())]
    return frames


def record_generation(
    request: GenerateRequest,
    received: float,
    first_token_at: float | None,
    last_token_at: float,
    done: GenerateDone,
) -> None:
    """The agent's span of a finished stream whose trace the platform sampled (the frame's
    traceparent says so; a malformed one is ignored): ``switchyard.agent.generate``, a child
    of the platform's span that sent it, from the frame's arrival to the last token, with
    OpenTelemetry's GenAI attributes and the first token as an event. Either engine calls it
    as it finishes a stream (possibly on its worker thread: the processor's queue is
    thread-safe); a failure is logged, never the stream's."""
    exporting = telemetry.exporting
    trace = request.trace
    finish_reason, input_tokens, output_tokens = (
        done.finish_reason,
        done.input_tokens,
        done.output_tokens,
    )
    if exporting is None or not trace or not telemetry.sampled(trace[-2:]):
        return
    parsed = telemetry.parse_traceparent(trace)
    if parsed is None:
        return
    try:
        ended = last_token_at if first_token_at is not None else time.perf_counter()
        attributes: dict[str, str | int | float | list[str]] = {
            "gen_ai.operation.name": "chat" if request.messages else "text_completion",
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": [finish_reason],
            "switchyard.agent.request_id": request.id,
            "switchyard.version.id": request.version_id,
            "switchyard.priority": PRIORITY_CLASSES[request.priority],
        }
        events: list[tuple[str, int, telemetry.Attributes]] = []
        if first_token_at is not None:
            attributes["gen_ai.server.time_to_first_token"] = first_token_at - received
            events.append(("gen_ai.first_token", exporting.epoch_ns(first_token_at), {}))
        exporting.span(
            "switchyard.agent.generate",
            parsed[0],
            telemetry.new_span_id(),
            parsed[1],
            exporting.epoch_ns(received),
            exporting.epoch_ns(ended),
            kind="server",
            attributes=attributes,
            events=events,
            remote_parent=True,
        )
    except Exception:
        logger.exception("could not record the span of generation %d", request.id)
