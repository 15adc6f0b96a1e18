"""Request serving: one binary frame from the platform in, its reply frames out. Infer requests
run through their version's batcher, generate requests join its engine's streams."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import telemetry
from ._batcher import RowsFailed
from ._exceptions import AgentError, BadInput, NotLoaded
from ._signature import check_inputs
from ._versions import Loaded, LoadedTextGen
from .protocol import (
    MAX_BUDGET_MS,
    PRIORITY_CLASSES,
    CancelGenerate,
    GenerateRequest,
    InferRequest,
    InferResult,
    Member,
    decode_frame,
    encode_frame,
    error_frame,
    tensor_of,
)

if TYPE_CHECKING:
    # Either engine: the torch one (_generate) or a python package's (_python_engine).
    from ._streaming import GenerationEngine as Engine
    from ._streaming import SendFrames

logger = logging.getLogger(__name__)

LATENCY_WINDOW = 1024


class FrameSender(Protocol):
    """Where replies go: the agent's ``Connection``, or a recorder in tests."""

    async def send_frames(self, frames: list[bytes]) -> None:
        """Send reply frames on the open connection (dropped while there is none)."""

    def stream_sender(self) -> SendFrames:
        """Sends a generation stream's frames on the open connection, never on a later one."""


def peek_request_id(frame: bytes) -> int | None:
    """The id of an infer frame whose header parses even though its tensors do not."""
    try:
        (head_len,) = struct.unpack_from("!I", frame)
        head = json.loads(frame[4 : 4 + head_len])
    except (struct.error, ValueError):
        return None
    if not isinstance(head, dict) or head.get("type") != "infer":
        return None
    request_id = head.get("id")
    return request_id if isinstance(request_id, int) else None


class Stats:
    """Request counters, a window of recent latencies (frame received -> reply sent), and the
    time requests spent in the agent since the last heartbeat."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.requests_total = 0
        self.errors_total = 0
        self.in_flight = 0
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._clock = clock
        self._busy_s = 0.0
        self._window_start = clock()

    def record(self, seconds: float, ok: bool, requests: int = 1) -> None:
        """``requests`` answered after ``seconds`` (a group's members, answered together)."""
        self.requests_total += requests
        self.errors_total += 0 if ok else requests
        if requests == 1:
            self.latencies.append(seconds)
        else:
            self.latencies.extend(itertools.repeat(seconds, requests))
        self._busy_s += seconds * requests

    def load_avg(self) -> float:
        """Requests in the agent (queued or running) on average since the last call: by
        Little's law, the time they spent here over the time that passed. A fast model's queue
        is almost always empty at the instant a heartbeat looks; this is not."""
        now = self._clock()
        elapsed, busy = now - self._window_start, self._busy_s
        self._window_start, self._busy_s = now, 0.0
        return busy / elapsed if elapsed > 0 else 0.0

    def percentiles_ms(self) -> tuple[float, float]:
        if not self.latencies:
            return 0.0, 0.0
        p50, p99 = np.percentile(np.fromiter(self.latencies, float), [50, 99]) * 1000
        return float(p50), float(p99)


class Serving:
    """Serves the platform's frames on the versions loaded now; every request id gets exactly
    one reply (a result, an error, or a stream that ends with done or an error).

    It reads the loaded versions and counts their use, but never loads or unloads one: that is
    the version set's job.
    """

    def __init__(
        self,
        loaded: Mapping[int, Loaded | LoadedTextGen],
        sender: FrameSender,
        stats: Stats | None = None,
    ) -> None:
        self.loaded = loaded
        self.sender = sender
        # One per connection (the main one and each data link), counting into the same stats.
        self.stats = stats or Stats()
        self._requests: set[asyncio.Task[None]] = set()
        self._stream_senders: set[SendFrames] = set()  # what this connection's streams use

    def handle_frame(self, frame: bytes) -> None:
        """Start serving one binary frame; every request id gets exactly one reply."""
        received = time.perf_counter()
        try:
            header, arrays = decode_frame(frame)
        except ValueError as exc:
            request_id = peek_request_id(frame)
            if request_id is None:
                logger.warning("ignoring undecodable frame: %s", exc)
                return
            self._track(self.reply(error_reply(request_id, BadInput(str(exc))), received, False))
            return
        if isinstance(header, InferRequest):
            self._track(self.serve_request(header, arrays, received))
        elif isinstance(header, GenerateRequest):
            self.start_generation(header, received)
        elif isinstance(header, CancelGenerate):
            self.cancel(header.id)
        else:
            logger.warning("ignoring %s frame from the platform", type(header).__name__)

    def cancel(self, request_id: int) -> None:
        """The caller gave up: a queued infer request is removed (and answered "cancelled"
        by its own task), a stream stops at its next step."""
        for loaded in self.loaded.values():
            if isinstance(loaded, LoadedTextGen):
                loaded.engine.cancel(request_id)
            elif loaded.batcher.cancel(request_id):
                return

    def start_generation(self, request: GenerateRequest, received: float) -> None:
        """Hand a stream to its version's engine, or answer with the error it gets."""
        loaded = self.loaded.get(request.version_id)
        try:
            if loaded is None:
                raise NotLoaded(f"version {request.version_id} is not ready on this agent")
            if not isinstance(loaded, LoadedTextGen):
                raise BadInput(f"version {request.version_id} does not generate text")
            send = self.sender.stream_sender()
            loaded.engine.submit(request, send, received)
            self._stream_senders.add(send)
            loaded.usage.requests_total += 1  # the engine's streams count what is in flight
            loaded.usage.last_used = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - every request id gets a reply
            self._track(self.sender.send_frames([error_reply(request.id, exc)]))

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._requests.add(task)  # cancelled when the connection drops
        task.add_done_callback(self._requests.discard)

    async def serve_request(
        self, request: InferRequest, arrays: list[np.ndarray], received: float
    ) -> None:
        """Run one request (or a group of them) and reply with its result or error frame."""
        # The budget becomes a deadline on this host's clock, counted from the frame's arrival.
        budget_ms = MAX_BUDGET_MS if request.budget_ms is None else request.budget_ms
        deadline = time.monotonic() + min(budget_ms, MAX_BUDGET_MS) / 1000
        loaded = self.loaded.get(request.version_id)
        usage = loaded.usage if loaded is not None else None
        del loaded  # an eviction must not find the version still referenced here
        requests = len(request.members) or 1
        if usage is not None:
            usage.started(requests)
        self.stats.in_flight += requests
        try:
            try:
                names, outputs, queue_s, compute_s = await self.infer(request, arrays, deadline)
                ran = time.perf_counter()
                reply = result_frame(request.id, names, outputs, queue_s, compute_s)
            except RowsFailed as failed:
                # Some members' rows failed on their own: each member gets its own answer.
                ran = time.perf_counter()
                frames = member_replies(request, failed)
                await self.sender.send_frames(frames)
                self.stats.record(time.perf_counter() - received, True, requests)
                if telemetry.exporting is not None:
                    record_spans(request, received, ran, failed.queue_s, failed.compute_s)
            except Exception as exc:  # noqa: BLE001 - every request id gets a reply
                for request_id, trace in traces_of(request):
                    # Follow one request end to end: the platform's span.
                    logger.info("request %d (trace %s) failed: %s", request_id, trace, exc)
                await self.reply(error_reply(request.id, exc), received, False, requests)
                if telemetry.exporting is not None:
                    code = exc.code if isinstance(exc, AgentError) else "internal"
                    record_spans(request, received, None, 0.0, 0.0, code)
            else:
                await self.reply(reply, received, True, requests)
                if telemetry.exporting is not None:  # off: this test is all tracing costs
                    record_spans(request, received, ran, queue_s, compute_s)
        finally:
            self.stats.in_flight -= requests
            if usage is not None:
                usage.finished(requests)

    async def reply(self, frame: bytes, received: float, ok: bool, requests: int = 1) -> None:
        await self.sender.send_frames([frame])
        self.stats.record(time.perf_counter() - received, ok, requests)

    async def infer(
        self, request: InferRequest, arrays: list[np.ndarray], deadline: float = math.inf
    ) -> tuple[list[str], list[np.ndarray], float, float]:
        """The requested outputs (names and arrays, in the model's order) for one request, and
        the seconds it waited for its batch and the seconds the batch's run took."""
        loaded = self.loaded.get(request.version_id)
        if loaded is None:
            raise NotLoaded(f"version {request.version_id} is not ready on this agent")
        if isinstance(loaded, LoadedTextGen):
            raise BadInput(f"version {request.version_id} generates text: send generate frames")
        inputs = {t.name: a for t, a in zip(request.inputs, arrays, strict=True)}
        if len(inputs) != len(request.inputs):
            raise BadInput("duplicate input names")
        model_outputs = loaded.runtime.output_names
        wanted = model_outputs if request.outputs is None else request.outputs
        unknown = sorted(set(wanted) - set(model_outputs))
        if unknown:
            raise BadInput(f"unknown outputs {unknown}; the model has {model_outputs}")
        rows = check_inputs(loaded.spec.inputs, inputs)
        if request.members and sum(m.rows for m in request.members) != rows:
            raise BadInput(f"the group's members hold {rows} rows, not their rows' sum")
        try:
            outputs, queue_s, compute_s = await loaded.batcher.infer_timed(
                inputs,
                caller=(request.tenant, request.key),
                priority=request.priority,
                deadline=deadline,
                request_id=request.id,
                weight=len(request.members) or 1,
            )
        except RowsFailed as failed:
            failed.outputs = [
                a for n, a in zip(model_outputs, failed.outputs, strict=True) if n in wanted
            ]
            failed.names = [n for n in model_outputs if n in wanted]
            raise
        picked = [(n, a) for n, a in zip(model_outputs, outputs, strict=True) if n in wanted]
        return [n for n, _ in picked], [a for _, a in picked], queue_s, compute_s

    def engines(self) -> list[Engine]:
        return [v.engine for v in self.loaded.values() if isinstance(v, LoadedTextGen)]

    def drop_connection(self) -> None:
        """The connection dropped: stop the work whose answers would go to it."""
        for task in list(self._requests):
            task.cancel()  # their replies have nowhere to go; the platform fails them
        senders, self._stream_senders = self._stream_senders, set()
        for engine in self.engines():
            engine.cancel_all(senders)  # nobody reads those streams any more; free their rows

    @property
    def busy(self) -> bool:
        """Whether requests or streams it was sent are still running."""
        return bool(self._requests)

    async def shutdown(self) -> None:
        """Cancel the requests still running and wait for them to end."""
        for task in list(self._requests):
            task.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)


def result_frame(
    request_id: int,
    names: list[str],
    outputs: list[np.ndarray],
    queue_s: float = 0.0,
    compute_s: float = 0.0,
) -> bytes:
    tensors = [tensor_of(n, a) for n, a in zip(names, outputs, strict=True)]
    header = InferResult(
        id=request_id,
        outputs=tensors,
        queue_ms=round(queue_s * 1000, 3),
        compute_ms=round(compute_s * 1000, 3),
    )
    return encode_frame(header, outputs)


def traces_of(request: InferRequest) -> list[tuple[int, str]]:
    """The traced requests a frame carries: its own, or its group's members'."""
    if request.members:
        return [(m.id, m.trace) for m in request.members if m.trace]
    return [(request.id, request.trace)] if request.trace else []


def record_spans(
    request: InferRequest,
    received: float,
    ran: float | None,
    queue_s: float,
    compute_s: float,
    error: str | None = None,
) -> None:
    """The agent's spans of an answered frame, for each of its requests whose trace the
    platform sampled (the frame's traceparent says so; a malformed one is ignored): the
    request on the agent (frame in, its outputs ready), a child of the platform's span that
    sent it, and in it the wait for a batch and the batch's run (``ran``: when it ended; None
    when the request failed before a run: then only the request's span, with its error code).
    The request's span ends before its reply is sent: the gateway may have answered its
    client before the agent's send returns, and a child should not outlast its parent."""
    try:
        _record_spans(request, received, ran, queue_s, compute_s, error)
    except Exception:  # the reply is sent: a tracing failure is logged, never the request's
        logger.exception("could not record the spans of request %d", request.id)


def _record_spans(
    request: InferRequest,
    received: float,
    ran: float | None,
    queue_s: float,
    compute_s: float,
    error: str | None,
) -> None:
    exporting = telemetry.exporting
    if exporting is None:
        return
    replied = time.perf_counter() if ran is None else ran
    members = request.members or [Member(request.id, 1, request.trace)]
    for member in members:
        if not member.trace or not telemetry.sampled(member.trace[-2:]):
            continue  # the cheap test first: most requests of a sampled fleet are not sampled
        parsed = telemetry.parse_traceparent(member.trace)
        if parsed is None:
            continue
        trace_id, parent_id, _ = parsed
        span_id = telemetry.new_span_id()
        attributes: dict[str, str | int] = {
            "switchyard.agent.request_id": member.id,
            "switchyard.version.id": request.version_id,
            "switchyard.priority": PRIORITY_CLASSES[request.priority],
            "switchyard.group.size": len(request.members) or 1,
        }
        if request.members:
            attributes["switchyard.rows"] = member.rows
        exporting.span(
            "switchyard.agent.infer",
            trace_id,
            span_id,
            parent_id,
            exporting.epoch_ns(received),
            exporting.epoch_ns(replied),
            kind="server",
            attributes=attributes,
            error=error,
            remote_parent=True,
        )
        if ran is None:
            continue
        run_started = ran - compute_s
        exporting.span(
            "switchyard.agent.queue",
            trace_id,
            telemetry.new_span_id(),
            span_id,
            exporting.epoch_ns(run_started - queue_s),
            exporting.epoch_ns(run_started),
        )
        exporting.span(
            "switchyard.agent.run",
            trace_id,
            telemetry.new_span_id(),
            span_id,
            exporting.epoch_ns(run_started),
            exporting.epoch_ns(ran),
        )


def member_replies(request: InferRequest, failed: RowsFailed) -> list[bytes]:
    """One frame per member of a group some of whose rows failed: an error for a member
    holding a failed row, its own rows of the outputs for the others."""
    frames = []
    start = 0
    for member in request.members:
        end = start + member.rows
        errors = [failed.row_errors[r] for r in range(start, end) if r in failed.row_errors]
        if errors:
            refused = BadInput(f"the model refused this input: {errors[0]}")
            frames.append(error_reply(member.id, refused))
        else:
            outputs = [a[start:end] for a in failed.outputs]
            frames.append(
                result_frame(member.id, failed.names, outputs, failed.queue_s, failed.compute_s)
            )
        start = end
    return frames


def error_reply(request_id: int, exc: Exception) -> bytes:
    """The error frame of a request that failed with ``exc``: an agent error's own code, else
    ``internal`` (logged, as nothing expected it)."""
    code = exc.code if isinstance(exc, AgentError) else "internal"
    if code == "internal":
        logger.warning("request %d failed: %r", request_id, exc)
    return error_frame(request_id, code, str(exc) or type(exc).__name__)
