"""Text generation for ``textgen`` versions: continuous batching over a KV cache.

One ``Engine`` per loaded version. Its scheduler task loops while streams are live; each turn is
one step on a worker thread: drop cancelled streams, admit new ones (prefill their prompts into
free cache rows), then ONE decode forward for every active stream, sample a token per stream and
turn it into text. The step's text goes to each connection as one ``TokenBatch`` frame (then any
``GenerateDone`` frames), in one message. A stream that arrives mid-generation joins
at the next step; a finished one leaves its row at once. Streams of different lengths share the
step through per-row positions and an attention mask (``TextGenModel.forward``).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import os
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from . import telemetry
from ._batcher import SchedCounts
from ._compute import ComputeMeter, RunTotals
from ._exceptions import BadInput, NotLoaded, Overloaded
from ._generation_stats import GenerationStats

# Shared with the python generator's engine, without torch; exported here as before.
from ._streaming import MAX_STOP_CHARS as MAX_STOP_CHARS
from ._streaming import MAX_STOPS as MAX_STOPS
from ._streaming import SendFrames as SendFrames
from ._streaming import find_stop as find_stop
from ._streaming import frames_by_sender as frames_by_sender
from ._streaming import held_back as held_back
from ._streaming import plain_chat_prompt as plain_chat_prompt
from ._streaming import record_generation
from .protocol import (
    MAX_BUDGET_MS,
    PRIORITY_CLASSES,
    ChatTurn,
    FinishReason,
    GenerateDone,
    GenerateRequest,
    GenerationLimits,
    TokenChunk,
    VersionSpec,
    encode_frame,
    error_frame,
)
from .textgen import (
    NEWLINE,
    Detokenizer,
    KVCache,
    TextGenModel,
    encode,
    from_safetensors,
    generate,
    sample,
)

logger = logging.getLogger(__name__)

# What a step produces for one stream: new text (sent in the step's ``TokenBatch``) or a frame.
Out = list[tuple["Stream", TokenChunk | bytes]]


class Detok(Protocol):
    """Turns a stream's tokens into text as they come, holding back incomplete characters."""

    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


class Cache(Protocol):
    """A decoder's KV cache: ``rows`` streams, each in its own row."""

    @property
    def rows(self) -> int: ...

    def grow(self, rows: int) -> None: ...

    def move(self, src: int, dst: int, length: int) -> None: ...


class Decoder(Protocol):
    """What the engine needs of a model and its tokenizer (``ByteDecoder`` for textgen,
    ``serving_agent._hf.HFDecoder`` for Hugging Face models)."""

    context: int  # positions a stream may reach: prompt plus output
    device: torch.device
    eos: frozenset[int]  # tokens that end a stream (not part of its text)

    def encode(self, text: str) -> list[int]: ...

    def start_tokens(self) -> list[int]:
        """What an empty prompt is fed as."""
        ...

    def detokenizer(self) -> Detok: ...

    def encode_chat(self, messages: Sequence[ChatTurn]) -> list[int]:
        """The prompt for a chat, by the model's chat template."""
        ...

    def new_cache(self, rows: int) -> Cache: ...

    def __call__(
        self, tokens: torch.Tensor, start: torch.Tensor, cache: Cache, row: int = 0
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of ``tokens`` ``[B, T]`` in cache rows ``row``.., each row's
        tokens at positions ``start[b]``.. (``TextGenModel.forward``'s contract)."""
        ...


class ByteDecoder:
    """The byte-level ``textgen`` model as a ``Decoder``."""

    def __init__(self, model: TextGenModel) -> None:
        self.model = model
        self.context = model.config.context
        self.device = model.device
        self.eos: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def start_tokens(self) -> list[int]:
        return [NEWLINE]

    def detokenizer(self) -> Detok:
        return Detokenizer()

    def encode_chat(self, messages: Sequence[ChatTurn]) -> list[int]:
        return encode(plain_chat_prompt(messages))

    def new_cache(self, rows: int) -> KVCache:
        return KVCache(self.model.config, rows, self.device)

    def __call__(
        self, tokens: torch.Tensor, start: torch.Tensor, cache: Cache, row: int = 0
    ) -> torch.Tensor:
        assert isinstance(cache, KVCache)
        return self.model(tokens, start, cache, row)


@dataclass(eq=False)
class Stream:
    """One generation: its request, its place in the batch, and what it has produced."""

    request: GenerateRequest
    prompt: list[int]  # at least one token
    send: SendFrames
    received: float
    generator: torch.Generator | None  # None: greedy
    detok: Detok = field(default_factory=Detokenizer)
    # perf_counter() past which it is not worth admitting: its first token would be late
    deadline: float = math.inf
    seq: int = 0  # arrival order, for FIFO within a priority class
    row: int = -1  # cache row while active
    pos: int = 0  # position of ``pending``, the token the next step feeds
    pending: int = 0
    text: str = ""  # text so far, including what is held back (a possible stop prefix)
    sent: int = 0  # characters of ``text`` already sent
    unsent_tokens: int = 0
    output_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    finish: FinishReason | None = None

    @property
    def id(self) -> int:
        return self.request.id


class Engine:
    """Decodes every stream of one generative version together, one token per stream per step.

    At most ``max_streams`` streams decode at once; ``max_waiting`` more (as many again by
    default) may wait for a slot, and past that a stream is refused ("overloaded"), unless it
    is of a better class than the worst one waiting, which is evicted for it. Waiting streams
    are admitted best class first (``GenerateRequest.priority``), in arrival order within a
    class; one whose admission deadline (``budget_ms`` from its arrival) passes while it
    waits is answered "expired" and never computed. Drops are counted in ``counts`` (the
    agent's ``SchedCounts``).

    The event loop owns admission (``submit``, ``cancel``) and sending; the worker thread owns
    the model, the KV cache and the active batch. They meet only between steps.
    """

    def __init__(
        self,
        model: TextGenModel | Decoder,
        limits: GenerationLimits | None = None,
        *,
        provider: str = "torch-cpu",
        threads: int = 1,
        counts: SchedCounts | None = None,
        meter: ComputeMeter | None = None,
    ) -> None:
        # The byte model is wrapped; a Hugging Face model comes as its adapter.
        self.model: Decoder = ByteDecoder(model) if isinstance(model, TextGenModel) else model
        self.limits = limits or GenerationLimits()
        self.provider = provider
        self.stats = GenerationStats()
        self.counts = counts or SchedCounts()  # the agent shares one across its versions
        # This version's compute: each step is a run whose rows are the streams it prefills
        # or decodes (the agent replaces the meter with its one shared meter).
        self.totals = RunTotals()
        self.meter = meter or ComputeMeter()
        # Rows grow (doubling) with the streams actually admitted, never past max_streams.
        self.cache = self.model.new_cache(min(4, self.limits.max_streams))
        self._active: list[Stream] = []  # worker-owned: row i of the cache is _active[i]
        self._live: dict[int, Stream] = {}  # loop-owned: every stream not yet finished
        # loop-owned: not yet admitted, sorted by (priority, seq): best class first, FIFO
        self._waiting: list[Stream] = []
        self._dropped: Out = []  # loop-owned: error frames of streams dropped unrun, to send
        self._seq = 0
        self._cancel: set[Stream] = set()  # loop-owned: to stop at the next step
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        threads = max(1, min(threads, os.cpu_count() or 1))
        # One thread: steps run one at a time and the cache needs no locks.
        self._executor = ThreadPoolExecutor(
            1, thread_name_prefix="textgen", initializer=torch.set_num_threads, initargs=(threads,)
        )

    @property
    def streams_active(self) -> int:
        return len(self._live)

    def outside_bytes(self) -> int:
        return 0  # the model lives in this process

    def set_limits(self, limits: GenerationLimits | None) -> None:
        """New limits apply to the next request; streams already running keep going."""
        self.limits = limits or GenerationLimits()

    # Event loop side ----------------------------------------------------------------------------

    def submit(
        self, request: GenerateRequest, send: SendFrames, received: float | None = None
    ) -> None:
        """Queue a stream for the next step, or raise the error its request gets."""
        if self._stopped:
            raise NotLoaded("version unloaded")
        limits, context = self.limits, self.model.context
        if request.messages:
            prompt = self.model.encode_chat(request.messages)
        else:
            prompt = self.model.encode(request.prompt)
        max_input = min(limits.max_input_tokens, context)
        if len(prompt) > max_input:
            raise BadInput(
                f"prompt is {len(prompt)} tokens; this version takes at most {max_input}"
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
        room = limits.max_waiting or limits.max_streams  # for streams waiting for a slot
        if len(self._live) >= limits.max_streams + room and not self._evict_for(request.priority):
            self.counts.shed += 1
            raise Overloaded(
                f"{limits.max_streams} streams already generating and {room} waiting on this "
                "replica"
            )
        generator = None
        if request.temperature > 0:
            generator = torch.Generator()
            if request.seed is None:
                generator.seed()
            else:
                generator.manual_seed(request.seed)
        arrived = time.perf_counter() if received is None else received
        budget_ms = request.budget_ms
        self._seq += 1
        stream = Stream(
            request=request,
            prompt=prompt or self.model.start_tokens(),
            send=send,
            received=arrived,
            generator=generator,
            detok=self.model.detokenizer(),
            deadline=math.inf
            if budget_ms is None
            else arrived + min(budget_ms, MAX_BUDGET_MS) / 1000,
            seq=self._seq,
        )
        self._live[request.id] = stream
        bisect.insort(self._waiting, stream, key=_admission_order)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="textgen")

    def _evict_for(self, priority: int) -> bool:
        """Make room for a stream of class ``priority`` by evicting the newest waiting stream
        of the worst class, if that class is worse; False when none is."""
        if not self._waiting or self._waiting[-1].request.priority <= priority:
            return False
        victim = self._waiting.pop()
        del self._live[victim.id]
        self.counts.shed += 1
        cls = PRIORITY_CLASSES[priority]
        message = f"evicted from the waiting streams for a {cls!r} stream"
        self._dropped.append((victim, error_frame(victim.id, "overloaded", message)))
        return True

    def _admissions(self, cancel: set[Stream]) -> list[Stream]:
        """The waiting streams that take the slots free after this step's cancels, best class
        first; waiting streams past their deadline are dropped (answered "expired"), cancelled
        ones are left to the step (which answers them "cancelled")."""
        now = time.perf_counter()
        kept: list[Stream] = []
        for stream in self._waiting:
            if stream in cancel:
                self.counts.cancelled += 1
            elif stream.deadline <= now:
                self.counts.expired += 1
                if self._live.get(stream.id) is stream:
                    del self._live[stream.id]
                waited_ms = (now - stream.received) * 1000
                message = (
                    f"waited {waited_ms:.0f} ms for a generation slot, past its budget of "
                    f"{stream.request.budget_ms:.0f} ms"
                )
                self._dropped.append((stream, error_frame(stream.id, "expired", message)))
            else:
                kept.append(stream)
        running = sum(1 for s in self._active if s not in cancel)
        free = max(0, self.limits.max_streams - running)
        admit, self._waiting = kept[:free], kept[free:]
        return admit

    def cancel(self, request_id: int) -> None:
        """Stop a stream at the next step; it ends with ``finish_reason="cancelled"``."""
        stream = self._live.get(request_id)
        if stream is not None:
            self._cancel.add(stream)
            self._wakeup.set()

    def cancel_all(self, senders: Collection[SendFrames] | None = None) -> None:
        """A connection dropped: stop its streams (those sending through ``senders``; every
        stream without) and free their rows at the next step."""
        gone = [s for s in self._live.values() if senders is None or s.send in senders]
        self._cancel.update(gone)
        for stream in gone:
            del self._live[stream.request.id]  # their ids are free for new requests
        self._wakeup.set()

    async def stop(self) -> None:
        """Finish the step in progress, fail every live stream with not_loaded, free memory."""
        self._stopped = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        await self._send(self._dropped)  # dropped while waiting: answered as they were
        self._dropped = []
        stranded = [*self._live.values()]
        self._live.clear()
        self._waiting.clear()
        self._cancel.clear()
        self._active = []
        for stream in stranded:
            await stream.send([error_frame(stream.id, "not_loaded", "version unloaded")])
        self._executor.shutdown(wait=False)
        self.cache = self.model.new_cache(0)  # give the memory back now

    async def _run(self) -> None:
        while not self._stopped:
            if not (self._waiting or self._cancel or self._active or self._dropped):
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self.step()

    async def step(self) -> None:
        """One scheduler turn: the step on the worker thread, then its frames out."""
        cancel, self._cancel = self._cancel, set()
        admit = self._admissions(cancel)
        dropped, self._dropped = self._dropped, []
        await self._send(dropped)  # before the step: these callers need not wait for it
        loop = asyncio.get_running_loop()
        rows = len(self._active) + len(admit)  # the worker is idle: its list is stable here
        now = time.perf_counter()
        self.totals.queue_wait_s += sum(now - stream.received for stream in admit)
        run_started = self.meter.start(self.totals)
        try:
            out, finished = await loop.run_in_executor(self._executor, self._step, admit, cancel)
        except Exception as exc:  # noqa: BLE001 - every stream must hear the failure
            logger.exception("generation step failed")
            out, finished = self._fail_all(admit, exc), [*admit, *self._active]
            self._active = []
        finally:
            self.meter.stop(self.totals, run_started, rows, self.provider)
        for stream in finished:
            if self._live.get(stream.id) is stream:
                del self._live[stream.id]
        await self._send(out)

    async def _send(self, out: Out) -> None:
        for send, frames in frames_by_sender(out).items():
            try:
                await send(frames)
            except Exception:  # noqa: BLE001 - one broken connection must not stop the others
                logger.exception("sending generation frames failed")

    def _fail_all(self, admit: list[Stream], exc: Exception) -> Out:
        message = f"generation failed: {exc}"
        out: Out = []
        for stream in [*admit, *self._active]:
            if stream.finish is None:
                stream.finish = "cancelled"  # ended: a late cancel must not send a done frame
                out.append((stream, error_frame(stream.id, "internal", message)))
        return out

    # Worker side -------------------------------------------------------------------------------

    @torch.inference_mode()
    def _step(self, admit: list[Stream], cancel: set[Stream]) -> tuple[Out, list[Stream]]:
        out: Out = []
        finished: list[Stream] = []
        for stream in cancel:
            if stream.finish is None:  # it may have finished on its own meanwhile
                self._finish(stream, "cancelled", out)
                finished.append(stream)
        self._release_finished()
        needed = len(self._active) + len(admit)  # the loop admitted at most max_streams
        if needed > self.cache.rows:
            self.cache.grow(max(needed, min(2 * self.cache.rows, self.limits.max_streams)))
        for stream in admit:
            if stream.finish is None:
                self._prefill(stream)
        if self._active:
            self._decode(out)
            finished.extend(s for s in self._active if s.finish is not None)
            self._release_finished()
        return out, finished

    def _prefill(self, stream: Stream) -> None:
        """Take the next free row and cache every prompt token but the last, which the next
        decode step feeds like any other stream's pending token."""
        stream.row = len(self._active)
        self._active.append(stream)
        prompt = stream.prompt
        if len(prompt) > 1:
            self.model(torch.tensor([prompt[:-1]]), torch.tensor([0]), self.cache, stream.row)
        stream.pending, stream.pos = prompt[-1], len(prompt) - 1

    def _decode(self, out: Out) -> None:
        batch = self._active
        tokens = torch.tensor([[s.pending] for s in batch])
        start = torch.tensor([s.pos for s in batch])
        logits = self.model(tokens, start, self.cache)[:, -1].float().cpu()
        self.stats.decode_steps_total += 1
        self.stats.max_decode_batch = max(self.stats.max_decode_batch, len(batch))
        greedy = logits.argmax(dim=-1).tolist()
        now = time.perf_counter()
        for i, stream in enumerate(batch):
            request = stream.request
            if request.temperature == 0:
                token = greedy[i]
            else:
                token = sample(
                    logits[i], request.temperature, request.top_p, stream.generator, request.top_k
                )
            self._append(stream, token, now, out)

    def _append(self, stream: Stream, token: int, now: float, out: Out) -> None:
        """Add one sampled token; send what text is safe to send; finish the stream if done."""
        self.stats.tokens_generated_total += 1
        stream.output_tokens += 1
        stream.unsent_tokens += 1
        if stream.first_token_at is None:
            stream.first_token_at = now
        stream.last_token_at = now
        stream.pending, stream.pos = token, stream.pos + 1
        if token in self.model.eos:  # the model ended its answer; the token is not text
            self._send_text(stream, len(stream.text), out)
            self._finish(stream, "stop", out)
            return
        searched = len(stream.text)
        stream.text += stream.detok.push(token)
        stops = [s for s in stream.request.stop if s]
        cut = find_stop(stream.text, stops, searched) if stops else None
        if cut is not None:
            stream.text = stream.text[:cut]  # the stop string is not part of the output
            self._send_text(stream, len(stream.text), out)
            self._finish(stream, "stop", out)
        elif (
            stream.output_tokens >= stream.request.max_new_tokens
            or stream.pos >= self.model.context
        ):
            self._send_text(stream, len(stream.text), out)
            self._finish(stream, "length", out)
        else:
            self._send_text(stream, len(stream.text) - held_back(stream.text, stops), out)

    def _send_text(self, stream: Stream, upto: int, out: Out) -> None:
        if upto > stream.sent:
            chunk = TokenChunk(
                id=stream.id, text=stream.text[stream.sent : upto], tokens=stream.unsent_tokens
            )
            out.append((stream, chunk))
            stream.sent, stream.unsent_tokens = upto, 0

    def _finish(self, stream: Stream, reason: FinishReason, out: Out) -> None:
        stream.finish = reason
        stream.detok.flush()
        if reason == "cancelled":
            self.stats.streams_cancelled_total += 1
        first = stream.first_token_at
        done = GenerateDone(
            id=stream.id,
            finish_reason=reason,
            input_tokens=len(stream.prompt),
            output_tokens=stream.output_tokens,
            ttft_ms=0.0 if first is None else (first - stream.received) * 1000,
            decode_ms=0.0 if first is None else (stream.last_token_at - first) * 1000,
        )
        out.append((stream, encode_frame(done)))
        if telemetry.exporting is not None:  # its span, when the platform sampled it
            record_generation(stream.request, stream.received, first, stream.last_token_at, done)

    def _release_finished(self) -> None:
        """Free the rows of finished streams, moving the last active stream into each hole so
        the batch stays rows 0..B-1 of the cache."""
        for stream in [s for s in self._active if s.finish is not None]:
            last = self._active[-1]
            if last is not stream:
                self.cache.move(last.row, stream.row, last.pos)
                self._active[stream.row], last.row = last, stream.row
            self._active.pop()
            stream.row = -1


def _admission_order(stream: Stream) -> tuple[int, int]:
    return stream.request.priority, stream.seq


# Loading ----------------------------------------------------------------------------------------


def pick_device(device: str) -> str:
    """CUDA when the spec allows it and torch sees a GPU, else the CPU."""
    if device != "cpu" and torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        logger.warning("device=cuda asked for, but torch sees no CUDA GPU: running on CPU")
    return "cpu"


def load_engine(path: Path, spec: VersionSpec, threads: int = 1) -> tuple[Engine, float]:
    """Load a textgen artifact and warm it up with one tiny generation (blocking; call it in a
    thread). Returns the engine and the warm-up's seconds."""
    torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
    device = pick_device(spec.device)
    try:
        model = from_safetensors(path, device)
    except RuntimeError as exc:  # CUDA out of memory or unusable
        if device == "cpu":
            raise
        logger.warning("loading on CUDA failed (%s): running on CPU", exc)
        device, model = "cpu", from_safetensors(path, "cpu")
    engine = Engine(model, spec.generation, provider=f"torch-{device}", threads=threads)
    started = time.perf_counter()
    generate(model, "The ", 4)  # allocates buffers and picks kernels before the first user
    return engine, time.perf_counter() - started
