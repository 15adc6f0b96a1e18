"""The ``python_generator`` format on the agent: a package whose class streams text, its
generators run in the package's sandboxed worker (``_python``), its streams served like the
built-in engine's (``_generate.Engine``): the same frames, limits and counters.

Each stream is a ``generate`` message to the worker, which advances every live generator one
item per round (``switchyard_client.model.serve_streams``) and answers each round with one
``step`` message. Every item a generator yields is one chunk of text and counts as **one
token**. The rules are the agent's, never the worker's: stop strings cut the text (and hold
back what may begin one), ``max_new_tokens`` ends a stream at that many items, a cancel ends it
at once; the worker is told to close the generator in each case. A worker that sends anything
but well-formed events for streams it was given is killed; so is one silent for the package's
``timeout_s`` while it has live streams (one ``next()`` of a generator may take at most that
long). Its streams then fail with the reason, and the next stream starts a new worker (its
``load()`` again).

The event loop owns everything here: the worker's socket is read by one task per worker, and
starting or killing a worker (blocking: ``load()``, waiting for the exit) runs in a thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from switchyard_client.model import pack, unpack

from . import telemetry
from ._batcher import SchedCounts
from ._compute import ComputeMeter, RunTotals
from ._exceptions import BadInput, NotLoaded, Overloaded
from ._generation_stats import GenerationStats
from ._python import PythonRuntime, _Process, environments, package_dir
from ._streaming import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    SendFrames,
    find_stop,
    frames_by_sender,
    held_back,
    plain_chat_prompt,
    record_generation,
)
from .package import read_package
from .protocol import (
    ErrorCode,
    FinishReason,
    GenerateDone,
    GenerateRequest,
    GenerationLimits,
    TokenChunk,
    VersionSpec,
    encode_frame,
    error_frame,
)

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 << 20  # one round's events from the worker
MAX_CHUNK_CHARS = 1 << 16  # one yielded string
MAX_ERROR_CHARS = 1200


class _Broken(Exception):
    """The worker broke the protocol: it is killed."""


class _Silent(Exception):
    """The worker said nothing for ``timeout_s`` while it had live streams: it is killed."""


@dataclass(eq=False)
class _Stream:
    request: GenerateRequest
    prompt: str
    send: SendFrames
    received: float  # perf_counter()
    stops: list[str]
    wire: int = 0  # its id on the worker's socket, once sent there
    worker: _Worker | None = None
    text: str = ""  # text so far, including what is held back (a possible stop prefix)
    sent: int = 0  # characters of ``text`` already sent
    unsent_tokens: int = 0
    output_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    ended: bool = False

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def input_tokens(self) -> int:
        return len(self.prompt.encode("utf-8"))  # as the gateway counts a prompt


@dataclass(eq=False)
class _Worker:
    process: _Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    streams: dict[int, _Stream] = field(default_factory=dict)  # by wire id: live on it
    # Wire ids the agent cancelled and the worker has not yet acknowledged: their late
    # events are ignored; once acknowledged, any mention of them is a protocol violation.
    gone: set[int] = field(default_factory=set)
    heard: float = 0.0  # monotonic(): its last message, or its first live stream's sending
    last_step: float = 0.0  # perf_counter() of its last step message (run time)
    lost: bool = False
    task: asyncio.Task[None] | None = None


Out = list[tuple[_Stream, TokenChunk | bytes]]


class PythonEngine:
    """Streams a ``python_generator`` package's text; at most ``max_streams`` streams at once
    (past that a stream is refused, "overloaded")."""

    def __init__(
        self,
        runtime: PythonRuntime,
        limits: GenerationLimits | None = None,
        *,
        counts: SchedCounts | None = None,
        meter: ComputeMeter | None = None,
    ) -> None:
        self.runtime = runtime
        self.timeout_s = runtime.manifest.timeout_s
        self.limits = limits or GenerationLimits()
        self.provider = runtime.provider
        self.stats = GenerationStats()
        self.counts = counts or SchedCounts()
        self.totals = RunTotals()
        self.meter = meter or ComputeMeter()  # unused: the work is the worker's, not ours
        self._live: dict[int, _Stream] = {}  # every stream not yet ended, by request id
        self._waiting: list[_Stream] = []  # not yet sent to a worker (one is starting)
        self._worker: _Worker | None = None
        self._starting: asyncio.Task[None] | None = None
        self._wire = itertools.count(1)
        self._outbox: deque[tuple[SendFrames, list[bytes]]] = deque()
        self._sender: asyncio.Task[None] | None = None
        self._sent = asyncio.Event()  # set while the outbox is empty
        self._sent.set()
        self._stopped = False

    @property
    def streams_active(self) -> int:
        return len(self._live)

    def outside_bytes(self) -> int:
        return self.runtime.outside_bytes()

    def set_limits(self, limits: GenerationLimits | None) -> None:
        """New limits apply to the next request; streams already running keep going."""
        self.limits = limits or GenerationLimits()

    # Streams ------------------------------------------------------------------------------------

    def submit(
        self, request: GenerateRequest, send: SendFrames, received: float | None = None
    ) -> None:
        """Send a stream to the worker (starting one if none runs), or raise the error its
        request gets."""
        if self._stopped:
            raise NotLoaded("version unloaded")
        limits = self.limits
        prompt = plain_chat_prompt(request.messages) if request.messages else request.prompt
        tokens = len(prompt.encode("utf-8"))
        if tokens > limits.max_input_tokens:
            raise BadInput(
                f"prompt is {tokens} tokens; this version takes at most {limits.max_input_tokens}"
            )
        if request.max_new_tokens > limits.max_output_tokens:
            raise BadInput(
                f"max_new_tokens is {request.max_new_tokens}; "
                f"this version generates at most {limits.max_output_tokens}"
            )
        if len(request.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in request.stop):
            raise BadInput(f"at most {MAX_STOPS} stop strings of {MAX_STOP_CHARS} characters")
        if request.id in self._live:
            raise BadInput(f"request id {request.id} is already generating")
        if len(self._live) >= limits.max_streams:
            self.counts.shed += 1
            raise Overloaded(f"{limits.max_streams} streams already generating on this replica")
        stream = _Stream(
            request=request,
            prompt=prompt,
            send=send,
            received=time.perf_counter() if received is None else received,
            stops=[s for s in request.stop if s],
        )
        self._live[request.id] = stream
        self._waiting.append(stream)
        self._kick()

    def cancel(self, request_id: int) -> None:
        """Stop a stream now; it ends with ``finish_reason="cancelled"``."""
        stream = self._live.get(request_id)
        if stream is None:
            return
        if stream in self._waiting:
            self._waiting.remove(stream)
            self.counts.cancelled += 1
        out: Out = []
        self._send_text(stream, len(stream.text) - held_back(stream.text, stream.stops), out)
        self._finish(stream, "cancelled", out)
        self._emit(out)

    def cancel_all(self, senders: Collection[SendFrames] | None = None) -> None:
        """A connection dropped: stop its streams (those sending through ``senders``; every
        stream without). Nothing is sent: their connection is gone."""
        for stream in [s for s in self._live.values() if senders is None or s.send in senders]:
            if stream in self._waiting:
                self._waiting.remove(stream)
            self.stats.streams_cancelled_total += 1
            self._end(stream, None, [])
        kept = [(s, f) for s, f in self._outbox if senders is not None and s not in senders]
        self._outbox = deque(kept)  # what was still to go to them goes nowhere

    async def stop(self) -> None:
        """Fail every live stream with not_loaded and stop the worker."""
        self._stopped = True
        tasks = [t for t in (self._starting, self._worker and self._worker.task) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._worker is not None:
            self._worker.writer.close()
        await asyncio.to_thread(self.runtime.close)
        if self._sender is not None:
            await asyncio.gather(self._sender, return_exceptions=True)
        await self._drain()
        stranded = list(self._live.values())
        self._live.clear()
        self._waiting.clear()
        for stream in stranded:
            try:
                await stream.send([error_frame(stream.id, "not_loaded", "version unloaded")])
            except Exception:  # noqa: BLE001 - one broken connection must not stop the others
                logger.exception("sending generation frames failed")

    # The worker ---------------------------------------------------------------------------------

    def _kick(self) -> None:
        """Send the waiting streams to the worker, starting one first if none runs."""
        if not self._waiting or self._stopped:
            return
        if self._worker is not None:
            if not self._worker.lost:  # else it is being ended: the next worker takes them
                self._dispatch(self._worker)
        elif self._starting is None:
            self._starting = asyncio.create_task(self._start(), name="python-generator-start")

    async def _start(self) -> None:
        try:
            try:
                process = await asyncio.to_thread(self.runtime.worker)
                reader, writer = await asyncio.open_unix_connection(sock=process.sock)
            except Exception as exc:  # noqa: BLE001 - the waiting streams' answer
                message = f"the model's worker could not start: {exc}"
                waiting, self._waiting = self._waiting, []
                out: Out = []
                for stream in waiting:
                    self._end(stream, error_frame(stream.id, "internal", message), out)
                self._emit(out)
                return
            worker = _Worker(process, reader, writer, heard=time.monotonic())
            worker.last_step = time.perf_counter()
            worker.task = asyncio.create_task(self._read(worker), name="python-generator-read")
            self._worker = worker
        finally:
            self._starting = None
        self._kick()

    def _dispatch(self, worker: _Worker) -> None:
        now = time.perf_counter()
        waiting, self._waiting = self._waiting, []
        for stream in waiting:
            if not worker.streams:  # its silence counts from now, not from when it went idle
                worker.heard = time.monotonic()
                worker.last_step = now
            stream.wire, stream.worker = next(self._wire), worker
            worker.streams[stream.wire] = stream
            self.totals.queue_wait_s += now - stream.received
            request = stream.request
            parameters: dict[str, Any] = {
                "max_new_tokens": request.max_new_tokens,
                "temperature": request.temperature,
                "top_p": request.top_p,
                "top_k": request.top_k,
                "stop": list(request.stop),
                "seed": request.seed,
            }
            header = {"op": "generate", "id": stream.wire, "prompt": stream.prompt}
            worker.writer.write(pack(header | {"parameters": parameters}))

    async def _read(self, worker: _Worker) -> None:
        """Read the worker's steps until it dies, breaks the protocol or falls silent."""
        reason, died = "", False
        try:
            while True:
                header = await self._message(worker)
                if header is None:
                    died = True
                    break
                worker.heard = time.monotonic()
                self._step(worker, header)
                # The next step waits for this one's frames to go out, as the built-in
                # engine's does: a slow connection slows the worker, never fills memory.
                await self._sent.wait()
                worker.heard = max(worker.heard, time.monotonic())  # our wait is not its silence
        except _Silent:
            reason = (
                f"the model's generate() did not yield within the package's {self.timeout_s:g} "
                "s: its worker was killed and starts again for the next stream"
            )
        except _Broken as exc:
            reason = f"the model's worker broke the protocol ({exc}): it was killed"
        except (ConnectionError, OSError):
            died = True
        await self._lose(worker, reason, died)

    async def _message(self, worker: _Worker) -> dict[str, Any] | None:
        """The worker's next message; None once it has closed its end."""
        while True:
            # While it has live streams it must speak within timeout_s of the last time it
            # did; idle, it may say nothing (the wait ends by then anyway, so that a stream
            # sent meanwhile is timed from its sending).
            wait = self.timeout_s
            if worker.streams:
                wait = worker.heard + self.timeout_s - time.monotonic()
                if wait <= 0:
                    raise _Silent
            try:
                # (asyncio.timeout, not wait_for: in 3.11 wait_for can swallow a cancel that
                # comes as the read completes, and stop() would wait for this task forever.)
                async with asyncio.timeout(wait):
                    head = await worker.reader.readexactly(4)
                break
            except TimeoutError:
                continue
            except asyncio.IncompleteReadError:
                return None
        length = int.from_bytes(head, "big")
        if not 4 <= length <= MAX_MESSAGE_BYTES:
            raise _Broken(f"a message of {length} bytes")
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await worker.reader.readexactly(length)
        except TimeoutError:
            raise _Silent from None
        except asyncio.IncompleteReadError:
            return None
        try:
            header, buffers = unpack(body)
        except ValueError as exc:
            raise _Broken(f"a malformed message: {exc}") from None
        if len(buffers):
            raise _Broken("buffers after a step's header")
        return header

    def _step(self, worker: _Worker, header: dict[str, Any]) -> None:
        """One round of the worker's generators: text, ends and errors of its live streams."""
        events = header.get("events")
        if header.get("op") != "step" or not isinstance(events, list) or not events:
            raise _Broken("a message that is not a step")
        if len(events) > 2 * (len(worker.streams) + len(worker.gone)):
            raise _Broken(f"{len(events)} events for {len(worker.streams)} streams")
        now = time.perf_counter()
        out: Out = []
        items = 0
        for event in events:
            wire = event.get("id") if isinstance(event, dict) else None
            if not isinstance(wire, int) or isinstance(wire, bool):
                raise _Broken("an event without a stream id")
            stream = worker.streams.get(wire)
            if stream is None:
                if wire not in worker.gone:
                    raise _Broken(f"an event of stream {wire}, which is not live on it")
                if event.get("cancelled") is True:
                    worker.gone.discard(wire)  # it has closed that generator
                continue  # what it made before it heard of the cancel
            if "text" in event:
                text = event["text"]
                if not isinstance(text, str):
                    raise _Broken("a text that is not a string")
                items += 1
                if len(text) > MAX_CHUNK_CHARS:
                    message = (
                        f"generate() yielded {len(text)} characters at once, more than "
                        f"{MAX_CHUNK_CHARS}"
                    )
                    self._end(stream, error_frame(stream.id, "internal", message), out)
                else:
                    self._append(stream, text, now, out)
            elif event.get("end") is True:  # the generator returned
                self._send_text(stream, len(stream.text), out)
                self._finish(stream, "stop", out, in_worker=False)
            elif isinstance(event.get("error"), str):  # it raised
                code: ErrorCode = "bad_input" if event.get("code") == "bad_input" else "internal"
                message = f"the model's code raised {event['error'][:MAX_ERROR_CHARS]}"
                self._end(stream, error_frame(stream.id, code, message), out, in_worker=False)
            else:
                raise _Broken("an event that is neither text, an end nor an error")
        self.stats.decode_steps_total += 1
        self.stats.max_decode_batch = max(self.stats.max_decode_batch, items)
        self.totals.runs += 1
        self.totals.rows += items
        self.totals.run_s += now - worker.last_step
        worker.last_step = now
        self._emit(out)

    async def _lose(self, worker: _Worker, reason: str, died: bool) -> None:
        """Kill a worker (or bury a dead one), fail its streams with why, and start the next
        one if streams are waiting."""
        worker.lost = True
        worker.writer.close()
        if not died:
            self._fail_streams(worker, reason)
        why = await asyncio.to_thread(self.runtime.end, worker.process, died)
        if died:
            self._fail_streams(worker, f"the model's worker died while generating: {why}")
        if why or reason:
            logger.warning("version %d: %s", self.runtime.spec.version_id, reason or why)
        if self._worker is worker:
            self._worker = None
        self._kick()

    def _fail_streams(self, worker: _Worker, message: str) -> None:
        out: Out = []
        for stream in list(worker.streams.values()):
            self._end(stream, error_frame(stream.id, "internal", message), out)
        self._emit(out)

    # A stream's text ----------------------------------------------------------------------------

    def _append(self, stream: _Stream, text: str, now: float, out: Out) -> None:
        """One yielded item: one token. Send what is safe to send; end the stream if done."""
        self.stats.tokens_generated_total += 1
        stream.output_tokens += 1
        stream.unsent_tokens += 1
        if stream.first_token_at is None:
            stream.first_token_at = now
        stream.last_token_at = now
        searched = len(stream.text)
        stream.text += text
        cut = find_stop(stream.text, stream.stops, searched) if stream.stops else None
        if cut is not None:
            stream.text = stream.text[:cut]  # the stop string is not part of the output
            self._send_text(stream, len(stream.text), out)
            self._finish(stream, "stop", out)
        elif stream.output_tokens >= stream.request.max_new_tokens:
            self._send_text(stream, len(stream.text), out)
            self._finish(stream, "length", out)
        else:
            self._send_text(stream, len(stream.text) - held_back(stream.text, stream.stops), out)

    def _send_text(self, stream: _Stream, upto: int, out: Out) -> None:
        if upto > stream.sent:
            chunk = TokenChunk(
                id=stream.id, text=stream.text[stream.sent : upto], tokens=stream.unsent_tokens
            )
            out.append((stream, chunk))
            stream.sent, stream.unsent_tokens = upto, 0

    def _finish(
        self, stream: _Stream, reason: FinishReason, out: Out, in_worker: bool = True
    ) -> None:
        if reason == "cancelled":
            self.stats.streams_cancelled_total += 1
        first = stream.first_token_at
        done = GenerateDone(
            id=stream.id,
            finish_reason=reason,
            input_tokens=stream.input_tokens,
            output_tokens=stream.output_tokens,
            ttft_ms=0.0 if first is None else (first - stream.received) * 1000,
            decode_ms=0.0 if first is None else (stream.last_token_at - first) * 1000,
        )
        self._end(stream, encode_frame(done), out, in_worker)
        if telemetry.exporting is not None:  # its span, when the platform sampled it
            record_generation(stream.request, stream.received, first, stream.last_token_at, done)

    def _end(self, stream: _Stream, frame: bytes | None, out: Out, in_worker: bool = True) -> None:
        """The stream is over (its last frame, if any, goes out): it leaves the live streams,
        and a worker still running its generator (``in_worker``) is told to close it."""
        if stream.ended:
            return
        stream.ended = True
        if self._live.get(stream.id) is stream:
            del self._live[stream.id]
        if stream in self._waiting:
            self._waiting.remove(stream)
        worker = stream.worker
        if worker is not None and worker.streams.pop(stream.wire, None) is not None:
            # Ended here (a stop, the length, a cancel, a chunk too long): the worker closes
            # the generator, and acknowledges.
            if in_worker and not worker.lost:
                worker.gone.add(stream.wire)
                worker.writer.write(pack({"op": "cancel", "id": stream.wire}))
        if frame is not None:
            out.append((stream, frame))

    # Sending ------------------------------------------------------------------------------------

    def _emit(self, out: Out) -> None:
        """Queue the frames, each connection's in order, for the one sending task."""
        if not out:
            return
        self._outbox.extend(frames_by_sender(out).items())
        self._sent.clear()
        if self._sender is None:
            self._sender = asyncio.create_task(self._drain(), name="python-generator-send")

    async def _drain(self) -> None:
        try:
            while self._outbox:
                send, frames = self._outbox.popleft()
                try:
                    await send(frames)
                except Exception:  # noqa: BLE001 - one broken connection must not stop the others
                    logger.exception("sending generation frames failed")
        finally:
            if self._sender is asyncio.current_task():
                self._sender = None
            if not self._outbox:
                self._sent.set()


# Loading ----------------------------------------------------------------------------------------


def load_python_engine(
    path: Path, spec: VersionSpec, threads: int = 1
) -> tuple[PythonEngine, float]:
    """The agent's loader for ``python_generator`` versions (``serving_agent.formats``): the
    package was prepared (``_python.prepare_python``); its worker is started and its class
    loaded. Returns the engine and the seconds the worker took to start and load."""
    target = package_dir(spec)
    package = read_package(target)
    if not package.manifest.generates:
        raise RuntimeError("the package does not say generates = true")
    key = package.environment_key()
    if not environments().ready(key):
        raise RuntimeError(f"the environment {key} is not built")
    runtime = PythonRuntime(spec, package, target, environments().python(key), generates=True)
    started = time.perf_counter()
    runtime.start()
    return PythonEngine(runtime, spec.generation), time.perf_counter() - started
