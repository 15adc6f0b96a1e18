"""The agent's connection to the platform: hello, assignments, inference and generation frames,
heartbeats.

Each step is a small method that can be tested alone; ``Agent.run`` strings them together and
reconnects. Loaded versions belong to the agent, not to a connection, so they survive
reconnects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import struct
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from ._batcher import INLINE_BELOW_S, Batcher
from ._cache import ArtifactCache
from ._exceptions import AgentError, BadInput, ChecksumMismatch, NotLoaded
from ._facts import node_facts
from ._runtime import Runtime, load_runtime, warm_up
from ._signature import check_inputs
from .protocol import (
    AGENT_WS_PATH,
    Assign,
    CancelGenerate,
    GenerateRequest,
    Heartbeat,
    Hello,
    InferError,
    InferRequest,
    InferResult,
    VersionSpec,
    VersionState,
    VersionStatus,
    decode_frame,
    encode_frame,
    pack_frames,
    tensor_of,
    unpack_frames,
)

if TYPE_CHECKING:
    from ._generate import Engine, Reply  # imports torch; loaded only for textgen versions

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CLOSE_BAD_TOKEN = 4401
LATENCY_WINDOW = 1024


# Fields that change what is loaded; a change in any other field (batching or generation
# limits) is applied to the running version without reloading it.
_ARTIFACT_FIELDS = {"sha256", "format", "device", "inputs", "outputs"}
_GENERATION_TOTALS = ("decode_steps_total", "streams_cancelled_total", "tokens_generated_total")


def ws_url(platform: str) -> str:
    """The agent websocket URL for a platform base URL (http -> ws, https -> wss)."""
    base = platform.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if base.startswith(http):
            base = ws + base.removeprefix(http)
    return base + AGENT_WS_PATH


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 10.0) -> float:
    """Exponential backoff with full jitter, so a fleet of agents does not reconnect in step."""
    return random.uniform(0, min(cap, base * 2**attempt))


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


def needs_reload(old: VersionSpec, new: VersionSpec) -> bool:
    return old.model_dump(include=_ARTIFACT_FIELDS) != new.model_dump(include=_ARTIFACT_FIELDS)


class AuthRejected(Exception):
    """The platform refused the node token (HTTP 401/403 or close code 4401)."""


class Sender(Protocol):
    async def send(self, message: str | bytes) -> None: ...


@dataclass(eq=False)
class Loaded:
    """A ready version: its spec, the model, and the batcher in front of it."""

    spec: VersionSpec
    runtime: Runtime
    batcher: Batcher

    @property
    def provider(self) -> str:
        return self.runtime.provider


@dataclass(eq=False)
class LoadedTextGen:
    """A ready ``textgen`` version: its spec and the engine decoding its streams."""

    spec: VersionSpec
    engine: Engine

    @property
    def provider(self) -> str:
        return self.engine.provider


class Stats:
    """Request counters and a window of recent latencies (frame received -> reply sent)."""

    def __init__(self) -> None:
        self.requests_total = 0
        self.errors_total = 0
        self.in_flight = 0
        self.latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def record(self, seconds: float, ok: bool) -> None:
        self.requests_total += 1
        self.errors_total += not ok
        self.latencies.append(seconds)

    def percentiles_ms(self) -> tuple[float, float]:
        if not self.latencies:
            return 0.0, 0.0
        p50, p99 = np.percentile(np.fromiter(self.latencies, float), [50, 99]) * 1000
        return float(p50), float(p99)


class Agent:
    """Serves the versions the platform assigns, over one websocket at a time."""

    def __init__(
        self,
        platform: str,
        token: str,
        cache: ArtifactCache,
        *,
        threads: int = 1,
        name: str | None = None,
        retry_base: float = 0.5,
        retry_cap: float = 10.0,
        auth_retry_s: float = 60.0,
        stable_s: float = 10.0,
    ) -> None:
        self.platform = platform.rstrip("/")
        self.url = ws_url(platform)
        self.cache = cache
        self.threads = threads
        self.name = name
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.auth_retry_s = auth_retry_s
        self.stable_s = stable_s  # a connection up this long resets the backoff
        self.headers = {"Authorization": f"Bearer {token}"}
        self.connection: Sender | None = None
        self.heartbeat_s = 5.0
        self.versions: dict[int, Loaded | LoadedTextGen] = {}
        self.stats = Stats()
        # Generation counters of unloaded versions, so the heartbeat's totals never go back.
        self._generation_retired = dict.fromkeys((*_GENERATION_TOTALS, "max_decode_batch"), 0)
        self._loading: dict[int, tuple[VersionSpec, asyncio.Task[None]]] = {}
        self._hello: Hello | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self._requests: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._outbox: list[bytes] = []
        self._replier: tuple[Sender | None, Reply] | None = None

    # Connection -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Connect and serve until ``stop`` is set, reconnecting with backoff; then unload all."""
        loop = asyncio.get_running_loop()
        attempt = 0
        try:
            while not stop.is_set():
                started = loop.time()
                delay = None
                try:
                    await self.connect_and_serve(stop)
                except AuthRejected as exc:
                    logger.error("platform rejected the node token (%s); check --token", exc)
                    delay = random.uniform(self.auth_retry_s / 2, self.auth_retry_s)
                except ConnectionClosed as exc:
                    logger.warning("connection lost: %s", exc)
                except (OSError, TimeoutError, WebSocketException) as exc:
                    logger.warning("cannot reach %s: %s", self.url, exc)
                except Exception:
                    logger.exception("connection failed unexpectedly")  # keep the node serving
                if stop.is_set():
                    break
                if loop.time() - started >= self.stable_s:
                    attempt = 0
                if delay is None:
                    delay = backoff_delay(attempt, self.retry_base, self.retry_cap)
                    attempt += 1
                logger.info("reconnecting in %.2f s", delay)
                try:
                    async with asyncio.timeout(delay):
                        await stop.wait()
                except TimeoutError:
                    pass
        finally:
            await self.shutdown()

    async def connect_and_serve(self, stop: asyncio.Event) -> None:
        """One connection: open it, serve it until it closes or ``stop`` is set."""
        try:
            ws = await self.open(stop)
            if ws is None:
                return
            async with ws:
                logger.info("connected to %s", self.url)
                await self.serve(ws, stop)
        except InvalidStatus as exc:
            if exc.response.status_code in (401, 403):
                raise AuthRejected(f"HTTP {exc.response.status_code}") from exc
            raise
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == CLOSE_BAD_TOKEN:
                raise AuthRejected(f"close code {CLOSE_BAD_TOKEN}") from exc
            raise

    async def open(self, stop: asyncio.Event) -> ClientConnection | None:
        """Open the websocket, or None if ``stop`` is set first (a dead host can take seconds)."""
        opening = asyncio.create_task(self._connect())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({opening, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not opening.done():
            opening.cancel()
            return None
        return opening.result()

    async def _connect(self) -> ClientConnection:
        return await connect(
            self.url,
            additional_headers=self.headers,
            max_size=MAX_MESSAGE_BYTES,
            compression=None,  # deflate would cost CPU on every inference frame
        )

    async def serve(self, ws: ClientConnection, stop: asyncio.Event) -> None:
        """Say hello, then handle messages until the connection closes."""
        await ws.send((await self.hello()).model_dump_json())
        self.connection = ws
        self._heartbeats = asyncio.create_task(self.heartbeat_loop(), name="heartbeats")
        closer = asyncio.create_task(self._close_on(stop, ws), name="closer")
        try:
            async for message in ws:
                self.handle_message(message)
        finally:
            self.connection = None
            self._outbox = []  # replies to the old connection's requests go nowhere
            self._heartbeats.cancel()
            closer.cancel()
            for task in list(self._requests):
                task.cancel()  # their replies have nowhere to go; the platform fails them
            for engine in self.engines():
                engine.cancel_all()  # nobody reads those streams any more; free their rows
        if not stop.is_set():
            logger.warning("platform closed the connection (code %s)", ws.close_code)

    async def hello(self) -> Hello:
        if self._hello is None:  # nvidia-smi is slow and the facts do not change
            self._hello = await asyncio.to_thread(node_facts, self.name)
        return self._hello

    async def _close_on(self, stop: asyncio.Event, ws: ClientConnection) -> None:
        await stop.wait()
        await ws.close()

    async def send(self, message: str | bytes) -> None:
        """Send on the current connection; dropped while disconnected (a reconnect re-syncs)."""
        connection = self.connection
        if connection is None:
            return
        try:
            await connection.send(message)
        except ConnectionClosed:
            pass

    async def send_frame(self, frame: bytes) -> None:
        await self.send_frames([frame])

    async def send_frames(self, frames: list[bytes], connection: Sender | None = None) -> None:
        """Queue reply frames; the first sender of an event-loop turn sends all of the turn's
        frames as one message (a finished batch wakes all its requests in the same turn).

        With ``connection``, the frames are dropped unless it is still the current one: a
        generation stream answers only on the connection it came from.
        """
        if connection is not None and connection is not self.connection:
            return
        self._outbox.extend(frames)
        if len(self._outbox) > len(frames):
            return  # an earlier reply of this turn is the flusher
        try:
            await asyncio.sleep(0)  # let the rest of this turn's replies join
        finally:
            # Taken even when cancelled, so the next reply finds an empty outbox and flushes.
            frames, self._outbox = self._outbox, []
        if frames:
            await self.send(pack_frames(frames))

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.send(self.heartbeat().model_dump_json())

    def heartbeat(self) -> Heartbeat:
        p50, p99 = self.stats.percentiles_ms()
        return Heartbeat(
            queue_depth=sum(
                v.batcher.depth for v in self.versions.values() if isinstance(v, Loaded)
            ),
            in_flight=self.stats.in_flight,
            requests_total=self.stats.requests_total,
            errors_total=self.stats.errors_total,
            p50_ms=p50,
            p99_ms=p99,
            streams_active=sum(e.streams_active for e in self.engines()),
            **self.generation_totals(),
        )

    def engines(self) -> list[Engine]:
        return [v.engine for v in self.versions.values() if isinstance(v, LoadedTextGen)]

    def generation_totals(self) -> dict[str, int]:
        """Generation counters summed over engines, past ones included; the largest batch is
        the largest any engine ran."""
        totals = dict(self._generation_retired)
        for engine in self.engines():
            for name in _GENERATION_TOTALS:
                totals[name] += getattr(engine.stats, name)
            totals["max_decode_batch"] = max(
                totals["max_decode_batch"], engine.stats.max_decode_batch
            )
        return totals

    def handle_message(self, message: str | bytes) -> None:
        """Dispatch one incoming message; never blocks, so the reader keeps reading."""
        if isinstance(message, str):
            self.handle_control(message)
            return
        try:
            frames = unpack_frames(message)
        except ValueError as exc:
            logger.warning("ignoring undecodable binary message: %s", exc)
            return
        for frame in frames:
            self.handle_frame(frame)

    # Assignments ------------------------------------------------------------------------------

    def handle_control(self, text: str) -> None:
        try:
            data = json.loads(text)
            kind = data.get("type") if isinstance(data, dict) else None
        except ValueError:
            kind = None
        if kind != "assign":
            logger.warning("ignoring control message of type %r", kind)
            return
        try:
            assign = Assign.model_validate(data)
        except ValidationError as exc:
            logger.error("ignoring invalid assign: %s", exc)
            return
        self.apply_assign(assign)

    def apply_assign(self, assign: Assign) -> None:
        """Converge on the assigned set: unload the rest, keep what is loaded, load what is new."""
        if assign.heartbeat_s != self.heartbeat_s:
            self.heartbeat_s = assign.heartbeat_s
            if self._heartbeats is not None and not self._heartbeats.done():
                # Restart rather than finish a sleep of the old (maybe much longer) interval.
                self._heartbeats.cancel()
                self._heartbeats = asyncio.create_task(self.heartbeat_loop(), name="heartbeats")
        wanted = {spec.version_id: spec for spec in assign.versions}
        logger.info("assigned versions %s", sorted(wanted))
        for version_id in {*self.versions, *self._loading} - wanted.keys():
            self.unload(version_id)
        for version_id, spec in wanted.items():
            loaded = self.versions.get(version_id)
            loading = self._loading.get(version_id)
            if loaded is not None and not needs_reload(loaded.spec, spec):
                self._set_limits(loaded, spec)
                # Repeat the state: after a reconnect the platform has not heard it from us.
                self._spawn(self.send_status(version_id, "ready", provider=loaded.provider))
            elif loading is not None and not needs_reload(loading[0], spec):
                self._loading[version_id] = (spec, loading[1])  # the load applies these limits
                self._spawn(self.send_status(version_id, "loading"))
            else:
                if loaded is not None or loading is not None:
                    self.unload(version_id, report=False)
                self._loading[version_id] = (spec, self._spawn(self.load(spec)))

    def _set_limits(self, loaded: Loaded | LoadedTextGen, spec: VersionSpec) -> None:
        loaded.spec = spec
        if isinstance(loaded, LoadedTextGen):
            loaded.engine.set_limits(spec.generation)
            return
        loaded.batcher.max_batch_size = spec.max_batch_size
        loaded.batcher.max_queue_delay_ms = spec.max_queue_delay_ms
        loaded.batcher.max_queue = spec.max_queue

    async def load(self, spec: VersionSpec) -> None:
        """Download, verify, load and warm up one version, reporting each outcome."""
        version_id = spec.version_id
        await self.send_status(version_id, "loading")
        try:
            url = self.platform + spec.artifact_url
            path = await self.cache.fetch(url, spec.sha256, self.headers)
        except ChecksumMismatch as exc:
            return await self._load_failed(version_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the platform as the failure
            return await self._load_failed(version_id, f"download failed: {exc}")
        if spec.format == "textgen":
            return await self.load_textgen(spec, path)
        try:
            runtime = await asyncio.to_thread(load_runtime, path, spec, self.threads)
        except Exception as exc:  # noqa: BLE001 - reported to the platform as the failure
            return await self._load_failed(version_id, f"load failed: {exc}")
        try:
            latency = await asyncio.to_thread(warm_up, runtime, spec)
        except BaseException as exc:
            runtime.close()
            if not isinstance(exc, Exception):
                raise
            return await self._load_failed(version_id, f"warm-up failed: {exc}")

        spec = self._loading.pop(version_id)[0]  # the latest assigned limits
        batcher = Batcher(
            runtime,
            max_batch_size=spec.max_batch_size,
            max_queue_delay_ms=spec.max_queue_delay_ms,
            max_queue=spec.max_queue,
            inline=latency < INLINE_BELOW_S,
        )
        self.versions[version_id] = Loaded(spec, runtime, batcher)
        logger.info(
            "version %d ready on %s (warm batch-1 %.3f ms, %s)",
            version_id,
            runtime.provider,
            latency * 1000,
            "inline" if batcher.inline else "worker thread",
        )
        await self.send_status(version_id, "ready", provider=runtime.provider)

    async def load_textgen(self, spec: VersionSpec, path: Path) -> None:
        """Load a textgen artifact onto an engine, warm it up with a tiny generation, report."""
        from ._generate import load_engine  # torch is imported only by nodes that generate

        version_id = spec.version_id
        try:
            engine, warm_s = await asyncio.to_thread(load_engine, path, spec, self.threads)
        except Exception as exc:  # noqa: BLE001 - reported to the platform as the failure
            return await self._load_failed(version_id, f"load failed: {exc}")
        spec = self._loading.pop(version_id)[0]  # the latest assigned limits
        engine.set_limits(spec.generation)
        self.versions[version_id] = LoadedTextGen(spec, engine)
        logger.info(
            "version %d ready on %s (textgen, warm-up generation %.1f ms)",
            version_id,
            engine.provider,
            warm_s * 1000,
        )
        await self.send_status(version_id, "ready", provider=engine.provider)

    async def _load_failed(self, version_id: int, detail: str) -> None:
        # No await since the failing step: this task is still the one registered for the id.
        self._loading.pop(version_id, None)
        logger.error("version %d failed to load: %s", version_id, detail)
        await self.send_status(version_id, "failed", detail=detail)

    def unload(self, version_id: int, report: bool = True) -> None:
        """Stop loading or serving a version; its waiting requests fail with not_loaded."""
        loading = self._loading.pop(version_id, None)
        if loading is not None:
            loading[1].cancel()
        loaded = self.versions.pop(version_id, None)
        if loaded is not None:
            self._spawn(self._close(loaded))
        logger.info("version %d unloaded", version_id)
        if report:
            self._spawn(self.send_status(version_id, "unloaded"))

    async def _close(self, loaded: Loaded | LoadedTextGen) -> None:
        if isinstance(loaded, LoadedTextGen):
            await loaded.engine.stop()
            stats = loaded.engine.stats
            for name in _GENERATION_TOTALS:
                self._generation_retired[name] += getattr(stats, name)
            retired = self._generation_retired
            retired["max_decode_batch"] = max(retired["max_decode_batch"], stats.max_decode_batch)
            return
        await loaded.batcher.stop()
        loaded.runtime.close()

    async def send_status(
        self, version_id: int, state: VersionState, detail: str = "", provider: str = ""
    ) -> None:
        status = VersionStatus(version_id=version_id, state=state, detail=detail, provider=provider)
        await self.send(status.model_dump_json())

    async def shutdown(self) -> None:
        """Unload everything and wait for background work; the agent is done afterwards."""
        for version_id in [*self.versions, *self._loading]:
            self.unload(version_id, report=False)
        for task in list(self._requests):
            task.cancel()
        await asyncio.gather(*self._background, *self._requests, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._background.add(task)  # a reference, so the task is not garbage collected
        task.add_done_callback(self._background.discard)
        return task

    # Inference --------------------------------------------------------------------------------

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
            self._track(self.reply(error_frame(request_id, BadInput(str(exc))), received, False))
            return
        if isinstance(header, InferRequest):
            self._track(self.serve_request(header, arrays, received))
        elif isinstance(header, GenerateRequest):
            self.start_generation(header, received)
        elif isinstance(header, CancelGenerate):
            for engine in self.engines():
                engine.cancel(header.id)
        else:
            logger.warning("ignoring %s frame from the platform", type(header).__name__)

    def start_generation(self, request: GenerateRequest, received: float) -> None:
        """Hand a stream to its version's engine, or answer with the error it gets."""
        loaded = self.versions.get(request.version_id)
        try:
            if loaded is None:
                raise NotLoaded(f"version {request.version_id} is not ready on this agent")
            if not isinstance(loaded, LoadedTextGen):
                raise BadInput(f"version {request.version_id} does not generate text")
            loaded.engine.submit(request, self.replier(), received)
        except Exception as exc:  # noqa: BLE001 - every request id gets a reply
            self._track(self.send_frame(error_frame(request.id, exc)))

    def replier(self) -> Reply:
        """Sends a stream's frames on the current connection, and never on a later one. One
        object per connection, so an engine step's frames go out together."""
        connection = self.connection
        if self._replier is None or self._replier[0] is not connection:
            self._replier = (connection, partial(self.send_frames, connection=connection))
        return self._replier[1]

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._requests.add(task)  # cancelled when the connection drops
        task.add_done_callback(self._requests.discard)

    async def serve_request(
        self, request: InferRequest, arrays: list[np.ndarray], received: float
    ) -> None:
        """Run one request and reply with its result or error frame."""
        self.stats.in_flight += 1
        try:
            try:
                names, outputs = await self.infer(request, arrays)
                reply = result_frame(request.id, names, outputs)
            except Exception as exc:  # noqa: BLE001 - every request id gets a reply
                await self.reply(error_frame(request.id, exc), received, ok=False)
            else:
                await self.reply(reply, received, ok=True)
        finally:
            self.stats.in_flight -= 1

    async def reply(self, frame: bytes, received: float, ok: bool) -> None:
        await self.send_frame(frame)
        self.stats.record(time.perf_counter() - received, ok)

    async def infer(
        self, request: InferRequest, arrays: list[np.ndarray]
    ) -> tuple[list[str], list[np.ndarray]]:
        """The requested outputs (names and arrays, in the model's order) for one request."""
        loaded = self.versions.get(request.version_id)
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
        check_inputs(loaded.spec.inputs, inputs)
        outputs = await loaded.batcher.infer(inputs)
        picked = [(n, a) for n, a in zip(model_outputs, outputs, strict=True) if n in wanted]
        return [n for n, _ in picked], [a for _, a in picked]


def result_frame(request_id: int, names: list[str], outputs: list[np.ndarray]) -> bytes:
    tensors = [tensor_of(n, a) for n, a in zip(names, outputs, strict=True)]
    return encode_frame(InferResult(id=request_id, outputs=tensors), outputs)


def error_frame(request_id: int, exc: Exception) -> bytes:
    code = exc.code if isinstance(exc, AgentError) else "internal"
    if code == "internal":
        logger.warning("request %d failed: %r", request_id, exc)
    message = str(exc) or type(exc).__name__
    return encode_frame(InferError(id=request_id, code=code, message=message))
