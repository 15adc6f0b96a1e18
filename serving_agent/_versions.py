"""The versions this agent holds: loading what the platform assigns (download, verify, make room,
load, warm up, measure), unloading the rest, and the memory budget that decides how many fit.

Memory: a version that does not fit the budget evicts the least recently used *cold* version
(nothing queued or running, idle for ``cold_after_s``), and the eviction is verified by
measuring that the memory came back before the new version loads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from ._batcher import INLINE_BELOW_S, Batcher, BatchSizes, SchedCounts
from ._cache import download_source
from ._compute import ACCEL_PROVIDERS, ComputeMeter
from ._exceptions import ChecksumMismatch
from ._generation_stats import GenerationStats
from ._memory import (
    MEASURABLE_BYTES,
    Reading,
    mib,
    read_memory,
    release_memory,
    released_enough,
)
from ._runtime import Runtime, warm_up
from ._text import text_wrapper
from .formats import FORMATS, EngineLoader, Format, RuntimeLoader
from .protocol import Assign, VersionLoad, VersionSpec, VersionState, VersionStatus

if TYPE_CHECKING:
    # Either engine: the torch one (_generate) or a python package's (_python_engine).
    from ._streaming import GenerationEngine as Engine

logger = logging.getLogger(__name__)

# Without the platform's estimate, a version is taken to need twice its artifact: ONNX Runtime
# holds a copy of the weights plus its arena for activations, a textgen engine the weights plus
# its KV cache. The real footprint is measured once it has loaded.
NEED_PER_ARTIFACT_BYTE = 2

T = TypeVar("T")


# Fields that change what is loaded; a change in any other field (batching or generation
# limits) is applied to the running version without reloading it.
_ARTIFACT_FIELDS = {"sha256", "format", "device", "inputs", "outputs"}


def needs_reload(old: VersionSpec, new: VersionSpec) -> bool:
    return old.model_dump(include=_ARTIFACT_FIELDS) != new.model_dump(include=_ARTIFACT_FIELDS)


def load_order(spec: VersionSpec) -> tuple[bool, int, int]:
    """Where a version's load goes among those assigned together: batch formats before the
    streaming ones (generators: torch and seconds of warm-up), then the smaller expected
    footprint (the platform's estimate), then the version id."""
    fmt = FORMATS.get(spec.format)
    return (fmt is None or fmt.streams, spec.memory_bytes, spec.version_id)


def estimate_need(spec: VersionSpec, path: Path) -> int:
    """Bytes a version is expected to take once loaded: the platform's estimate, else a multiple
    of its artifact's size."""
    return spec.memory_bytes or NEED_PER_ARTIFACT_BYTE * path.stat().st_size


@dataclass(eq=False)
class VersionUsage:
    """What one loaded version holds and how recently it was used: the eviction's inputs."""

    memory_bytes: int = 0  # counted against the budget: max(measured, artifact size)
    measured_bytes: int = 0  # what loading it measurably added
    artifact_bytes: int = 0
    on_cuda: bool = False  # measured as CUDA memory rather than host RSS
    loaded_at: float = field(default_factory=time.monotonic)
    last_used: float | None = None  # time.monotonic() of its latest request
    in_flight: int = 0
    requests_total: int = 0
    load_s: float = 0.0  # download to ready, warm-up included

    @property
    def releasable_bytes(self) -> int:
        """What unloading it must give back: its measured footprint, but no more than its
        artifact. The first version of each runtime also paid that runtime's one-time setup,
        which no unload returns (measured: ONNX Runtime's environment ~8 MiB, torch's first
        textgen load ~75 MiB)."""
        return min(self.measured_bytes, self.artifact_bytes)

    @property
    def last_active(self) -> float:
        return self.loaded_at if self.last_used is None else self.last_used

    def started(self, requests: int = 1) -> None:
        self.in_flight += requests
        self.last_used = time.monotonic()

    def finished(self, requests: int = 1) -> None:
        self.in_flight -= requests
        self.requests_total += requests
        self.last_used = time.monotonic()


def measure_usage(before: Reading, after: Reading, provider: str, path: Path) -> VersionUsage:
    """A new version's usage from readings taken around its load and warm-up. A tiny model is
    lost in allocator noise, so it counts at least its artifact's size: never zero."""
    on_cuda = provider in ACCEL_PROVIDERS
    measured = max(0, after.minus(before, on_cuda))
    size = path.stat().st_size
    return VersionUsage(
        memory_bytes=max(measured, size),
        measured_bytes=measured,
        artifact_bytes=size,
        on_cuda=on_cuda,
    )


def settled_reading(collect: bool = True) -> Reading:
    """Memory in use once freed memory went back to the OS (blocking; call it in a thread).

    Readings around a load skip the garbage collection (``collect=False``): a model's memory
    is freed by reference counting, and a full collection of an unfrozen heap holding torch
    costs 0.1-0.3 s. Evictions pay it, since there a missed cycle would read as a leak.
    """
    release_memory(collect)
    return read_memory()


def settled_load_reading() -> Reading:
    return settled_reading(collect=False)


@dataclass(eq=False)
class Loaded:
    """A ready version: its spec, the model, the batcher in front of it, and its usage."""

    spec: VersionSpec
    runtime: Runtime
    batcher: Batcher
    usage: VersionUsage = field(default_factory=VersionUsage)

    @property
    def provider(self) -> str:
        return self.runtime.provider

    @property
    def in_flight(self) -> int:
        return self.usage.in_flight

    @property
    def queue_depth(self) -> int:
        return self.batcher.depth


@dataclass(eq=False)
class LoadedTextGen:
    """A ready ``textgen`` version: its spec, the engine decoding its streams, and its usage."""

    spec: VersionSpec
    engine: Engine
    usage: VersionUsage = field(default_factory=VersionUsage)

    @property
    def provider(self) -> str:
        return self.engine.provider

    @property
    def in_flight(self) -> int:
        return self.engine.streams_active

    @property
    def queue_depth(self) -> int:
        return 0  # streams wait for the next step, which is a few milliseconds away


class Artifacts(Protocol):
    """Where artifacts come from: ``ArtifactCache``, which downloads each once and checks its
    sha256 (raising ``ChecksumMismatch``), or an in-memory fake in tests."""

    async def fetch(self, url: str, sha256: str, headers: Mapping[str, str]) -> Path: ...


# Where the set reports each version's state (loading, ready, failed, unloaded, evicted).
ReportStatus = Callable[[VersionStatus], Awaitable[None]]


class VersionSet:
    """The versions this agent holds, by id. Loaded versions belong to the agent, not to a
    connection, so they survive reconnects; their states go out through ``report``."""

    def __init__(
        self,
        cache: Artifacts,
        report: ReportStatus,
        *,
        platform: str,
        headers: Mapping[str, str],
        memory_budget: Callable[[], Awaitable[int]],
        threads: int = 1,
        cold_after_s: float = 30.0,
    ) -> None:
        self.cache = cache
        self._report = report
        self.platform = platform  # artifact URLs are relative to it
        self.headers = headers
        # The node's budget in bytes (0: none to keep), settled once the node's facts are read.
        self.memory_budget = memory_budget
        self.threads = threads
        self.cold_after_s = cold_after_s  # idle this long (and nothing queued): may be evicted
        self.loaded: dict[int, Loaded | LoadedTextGen] = {}
        self.batch_sizes = BatchSizes()  # shared by every version's batcher
        self.sched_counts = SchedCounts()  # likewise
        self.meter = ComputeMeter()  # likewise: it splits CPU time between concurrent runs
        # Generation counters of unloaded versions, so the heartbeat's totals never go back.
        self._generation_retired = GenerationStats()
        self._loading: dict[int, tuple[VersionSpec, asyncio.Task[None]]] = {}
        # Versions this agent unloaded to make room (id -> the eviction's detail), and versions
        # that could not get room (id -> their spec and why). Neither is loaded again while the
        # platform keeps assigning it; each is forgotten once an assign leaves it out.
        self.evicted: dict[int, str] = {}
        self.unfit: dict[int, tuple[VersionSpec, str]] = {}
        # Loads take turns: a footprint is the memory gained while one version loads, and each
        # fit check must count the version that loaded just before it.
        self._load_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()

    # Assignments ------------------------------------------------------------------------------

    def apply(self, assign: Assign) -> None:
        """Converge on the assigned set: unload the rest, keep what is loaded, load what is new."""
        wanted = {spec.version_id: spec for spec in assign.versions}
        logger.info("assigned versions %s", sorted(wanted))
        for version_id in {*self.loaded, *self._loading} - wanted.keys():
            self.unload(version_id)
        # Evicted and unfit versions are retried only after they left the assignment and came
        # back: retrying while still assigned would evict another version, which would evict
        # this one back in turn. Re-assigning the same content (a reconnect does) changes nothing.
        for version_id in [*self.evicted]:
            if version_id not in wanted:
                del self.evicted[version_id]
        for version_id, (unfit, _) in [*self.unfit.items()]:
            spec = wanted.get(version_id)
            if spec is None or needs_reload(unfit, spec) or unfit.memory_bytes != spec.memory_bytes:
                del self.unfit[version_id]
        # Smallest first: loads take the load lock in the order they reach it, so after a
        # restart a 20 µs classifier is not left waiting behind a text generator's seconds.
        for version_id, spec in sorted(wanted.items(), key=lambda item: load_order(item[1])):
            loaded = self.loaded.get(version_id)
            loading = self._loading.get(version_id)
            # Repeat each state: after a reconnect the platform has not heard it from us.
            if version_id in self.evicted:
                detail = self.evicted[version_id]
                self._spawn(self.send_status(version_id, "evicted", detail=detail))
            elif version_id in self.unfit:
                detail = self.unfit[version_id][1]
                self._spawn(self.send_status(version_id, "failed", detail=detail))
            elif loaded is not None and not needs_reload(loaded.spec, spec):
                self._set_limits(loaded, spec)
                self._spawn(
                    self.send_status(
                        version_id,
                        "ready",
                        provider=loaded.provider,
                        memory_bytes=loaded.usage.memory_bytes,
                    )
                )
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
        loaded.batcher.max_queue_per_caller = spec.max_queue_per_caller

    async def load(self, spec: VersionSpec) -> None:
        """Download, verify, make room for, load and warm up one version, reporting each
        outcome."""
        version_id = spec.version_id
        started = time.perf_counter()
        await self.send_status(version_id, "loading")
        fmt = FORMATS.get(spec.format)
        if fmt is None:  # a platform newer than this agent: this version fails, not the others
            return await self._load_failed(
                version_id, f"this agent does not serve the {spec.format!r} format"
            )
        tokenizer: Path | None = None
        try:
            # A presigned bucket URL gets no node headers (download_source).
            url, headers = download_source(self.platform, spec.artifact_url, self.headers)
            path = await self.cache.fetch(url, spec.sha256, headers)
            if spec.tokenizer_url:  # verified against its hash like the artifact
                url, headers = download_source(self.platform, spec.tokenizer_url, self.headers)
                tokenizer = await self.cache.fetch(url, spec.tokenizer_sha256, headers)
        except ChecksumMismatch as exc:
            return await self._load_failed(version_id, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the platform as the failure
            return await self._load_failed(version_id, f"download failed: {exc}")
        if fmt.prepare is not None:
            problem = await self._prepare(fmt, path, spec)
            if problem is not None:
                return await self._load_failed(version_id, problem)
        async with self._load_lock:
            problem = await self.make_room(version_id, estimate_need(spec, path))
            if problem is not None:
                self.unfit[version_id] = (self._loading.get(version_id, (spec,))[0], problem)
                return await self._load_failed(version_id, problem)
            # Imports the loader's module, and torch (hundreds of MiB) with it on the first
            # version of a format built on torch: before the reading, so that version's
            # footprint is its own; in a thread, as it takes seconds.
            load = await asyncio.to_thread(fmt.load_function)
            before = await asyncio.to_thread(settled_load_reading)
            if fmt.streams:
                await self.load_engine(spec, path, before, cast(EngineLoader, load))
            else:
                await self.load_batched(spec, path, before, cast(RuntimeLoader, load), tokenizer)
            loaded = self.loaded.get(version_id)
            if loaded is not None:
                loaded.usage.load_s = time.perf_counter() - started

    async def _prepare(self, fmt: Format, path: Path, spec: VersionSpec) -> str | None:
        """The format's step before loading (a python package's environment), outside the
        load lock: minutes of installing must not hold up other versions' loads. None once
        done, else why it failed."""

        async def progress(detail: str) -> None:
            await self.send_status(spec.version_id, "loading", detail=detail)

        try:
            prepare = await asyncio.to_thread(fmt.prepare_function)
            assert prepare is not None
            await prepare(path, spec, progress)
        except Exception as exc:  # noqa: BLE001 - reported to the platform as the failure
            return f"preparing failed: {exc}"
        return None

    async def load_batched(
        self,
        spec: VersionSpec,
        path: Path,
        before: Reading,
        load: RuntimeLoader,
        tokenizer: Path | None = None,
    ) -> None:
        """Load an artifact as a runtime (behind its tokenizer, if any) behind a batcher, warm
        it up, measure it, report."""
        version_id = spec.version_id
        try:
            wrap = text_wrapper(tokenizer, spec) if tokenizer is not None else None
            runtime = await asyncio.to_thread(load, path, spec, self.threads, wrap=wrap)
        except Exception as exc:  # noqa: BLE001 - reported to the platform as the failure
            return await self._load_failed(version_id, f"load failed: {exc}")
        try:
            latency = await asyncio.to_thread(warm_up, runtime, spec)
        except BaseException as exc:
            runtime.close()
            if not isinstance(exc, Exception):
                raise
            return await self._load_failed(version_id, f"warm-up failed: {exc}")
        usage = measure_usage(
            before, await asyncio.to_thread(settled_load_reading), runtime.provider, path
        )
        outside = runtime.outside_bytes()  # a worker process's, which no agent reading sees
        usage.memory_bytes += outside
        usage.measured_bytes += outside

        spec = self._loading.pop(version_id)[0]  # the latest assigned limits
        batcher = Batcher(
            runtime,
            max_batch_size=spec.max_batch_size,
            max_queue_delay_ms=spec.max_queue_delay_ms,
            max_queue=spec.max_queue,
            max_queue_per_caller=spec.max_queue_per_caller,
            inline=latency < INLINE_BELOW_S and not runtime.blocks,
            batch_sizes=self.batch_sizes,
            counts=self.sched_counts,
            meter=self.meter,
        )
        self.loaded[version_id] = Loaded(spec, runtime, batcher, usage)
        logger.info(
            "version %d ready on %s (warm batch-1 %.3f ms, %s, %s measured)",
            version_id,
            runtime.provider,
            latency * 1000,
            "inline" if batcher.inline else "worker thread",
            mib(usage.measured_bytes),
        )
        await self.send_status(
            version_id, "ready", provider=runtime.provider, memory_bytes=usage.memory_bytes
        )

    async def load_engine(
        self, spec: VersionSpec, path: Path, before: Reading, load: EngineLoader
    ) -> None:
        """Load an artifact onto a generation engine, warmed up with a tiny generation, measure
        it, report."""
        version_id = spec.version_id
        try:
            engine, warm_s = await asyncio.to_thread(load, path, spec, self.threads)
        except Exception as exc:  # noqa: BLE001 - reported to the platform as the failure
            return await self._load_failed(version_id, f"load failed: {exc}")
        usage = measure_usage(
            before, await asyncio.to_thread(settled_load_reading), engine.provider, path
        )
        outside = engine.outside_bytes()  # a worker process's, which no agent reading sees
        usage.memory_bytes += outside
        usage.measured_bytes += outside
        spec = self._loading.pop(version_id)[0]  # the latest assigned limits
        engine.set_limits(spec.generation)
        engine.counts = self.sched_counts  # its drops are the agent's, as its batchers'
        engine.meter = self.meter
        self.loaded[version_id] = LoadedTextGen(spec, engine, usage)
        logger.info(
            "version %d ready on %s (%s, warm-up generation %.1f ms, %s measured)",
            version_id,
            spec.format,
            engine.provider,
            warm_s * 1000,
            mib(usage.measured_bytes),
        )
        await self.send_status(
            version_id, "ready", provider=engine.provider, memory_bytes=usage.memory_bytes
        )

    # Memory -----------------------------------------------------------------------------------

    async def make_room(self, version_id: int, need: int) -> str | None:
        """Evict least recently used cold versions until ``need`` more bytes fit the budget.
        None once they fit; else why the version cannot load (reported as its failure)."""
        budget = await self.memory_budget()
        if budget <= 0:
            return None  # the node's memory could not be read: no limit to keep
        if need > budget:  # evicting everything would not help; keep what serves now
            return f"does not fit: needs {mib(need)}, more than the whole budget of {mib(budget)}"
        while (used := self.memory_used()) + need > budget:
            victim = self.coldest_version()
            if victim is None:
                return (
                    f"does not fit: needs {mib(need)}, {mib(max(0, budget - used))} free of "
                    f"{mib(budget)}, no cold version to evict"
                )
            # Taken out now, not in the task: a request arriving in between would find it
            # loaded and busy. The task runs to the end even if this load is cancelled, so the
            # platform always hears of the eviction.
            self.evicted[victim] = f"evicted to load v{version_id}"
            evicting = self._spawn(self.evict(self.loaded.pop(victim), version_id))
            problem = await asyncio.shield(evicting)
            if problem is not None:
                return problem
        return None

    def coldest_version(self) -> int | None:
        """The least recently used loaded version with nothing queued or running that has been
        idle for ``cold_after_s``; None if every version is busy or was used lately."""
        now = time.monotonic()
        cold = [
            (loaded.usage.last_active, version_id)
            for version_id, loaded in self.loaded.items()
            if not (loaded.in_flight or loaded.queue_depth)
            and now - loaded.usage.last_active >= self.cold_after_s
        ]
        return min(cold)[1] if cold else None

    async def evict(self, loaded: Loaded | LoadedTextGen, for_version: int) -> str | None:
        """Unload a version to make room and check its memory came back. None when it did;
        else why the version it made room for must not load."""
        version_id, usage = loaded.spec.version_id, loaded.usage
        # Settled first, so garbage of earlier work is not taken for the victim's memory.
        before = await asyncio.to_thread(settled_reading)
        await self._close(loaded)
        del loaded  # the last reference: a textgen engine keeps its weights while it lives
        freed = -(await asyncio.to_thread(settled_reading)).minus(before, usage.on_cuda)
        expected = usage.releasable_bytes
        released = released_enough(expected, freed)
        if not released:
            how = f"memory not released, {mib(expected)} expected"
        elif expected >= MEASURABLE_BYTES:
            how = f"measured, {mib(expected)} expected"
        else:
            how = f"not verified, {mib(expected)} expected is too little to tell"
        detail = f"evicted to load v{for_version}: freed {mib(freed)} ({how})"
        if version_id in self.evicted:  # unless an assign already left it out
            self.evicted[version_id] = detail
        await self.send_status(version_id, "evicted", detail=detail)
        if released:
            logger.info("version %d %s", version_id, detail)
            return None
        logger.warning("version %d %s; not loading v%d", version_id, detail, for_version)
        return (
            f"memory not released: evicting v{version_id} freed {mib(freed)} of the "
            f"{mib(expected)} expected"
        )

    async def _load_failed(self, version_id: int, detail: str) -> None:
        # Still the task registered for the id: an unload or a reload cancels it at an await.
        self._loading.pop(version_id, None)
        logger.error("version %d failed to load: %s", version_id, detail)
        await self.send_status(version_id, "failed", detail=detail)

    def unload(self, version_id: int, report: bool = True) -> None:
        """Stop loading or serving a version; its waiting requests fail with not_loaded."""
        loading = self._loading.pop(version_id, None)
        if loading is not None:
            loading[1].cancel()
        loaded = self.loaded.pop(version_id, None)
        if loaded is not None:
            self._spawn(self._close(loaded))
        logger.info("version %d unloaded", version_id)
        if report:
            self._spawn(self.send_status(version_id, "unloaded"))

    async def _close(self, loaded: Loaded | LoadedTextGen) -> None:
        if isinstance(loaded, LoadedTextGen):
            await loaded.engine.stop()
            self._generation_retired.add(loaded.engine.stats)
            return
        await loaded.batcher.stop()
        loaded.runtime.close()

    async def send_status(
        self,
        version_id: int,
        state: VersionState,
        detail: str = "",
        provider: str = "",
        memory_bytes: int = 0,
    ) -> None:
        status = VersionStatus(
            version_id=version_id,
            state=state,
            detail=detail,
            provider=provider,
            memory_bytes=memory_bytes,
        )
        await self._report(status)

    async def shutdown(self) -> None:
        """Unload everything and wait for background work (closes, reports)."""
        for version_id in [*self.loaded, *self._loading]:
            self.unload(version_id, report=False)
        await asyncio.gather(*self._background, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        self._background.add(task)  # a reference, so the task is not garbage collected
        task.add_done_callback(self._background.discard)
        return task

    # For heartbeats ---------------------------------------------------------------------------

    def queue_depth(self) -> int:
        return sum(v.queue_depth for v in self.loaded.values())

    def streams_active(self) -> int:
        return sum(e.streams_active for e in self.engines())

    def loads(self) -> list[VersionLoad]:
        """Each loaded version's load, by id."""
        return [self.version_load(v) for _, v in sorted(self.loaded.items())]

    def version_load(self, loaded: Loaded | LoadedTextGen) -> VersionLoad:
        last_used = loaded.usage.last_used
        totals = loaded.batcher.totals if isinstance(loaded, Loaded) else loaded.engine.totals
        return VersionLoad(
            version_id=loaded.spec.version_id,
            memory_bytes=loaded.usage.memory_bytes,
            queue_depth=loaded.queue_depth,
            in_flight=loaded.in_flight,
            requests_total=loaded.usage.requests_total,
            idle_s=None if last_used is None else time.monotonic() - last_used,
            load_s=round(loaded.usage.load_s, 4),
            cpu_s_total=totals.cpu_s,
            accel_s_total=totals.accel_s,
            runs_total=totals.runs,
            run_rows_total=totals.rows,
            run_s_total=totals.run_s,
            queue_wait_s_total=totals.queue_wait_s,
        )

    def memory_used(self) -> int:
        """Bytes the loaded versions hold, by the footprints measured when they loaded."""
        return sum(v.usage.memory_bytes for v in self.loaded.values())

    def engines(self) -> list[Engine]:
        return [v.engine for v in self.loaded.values() if isinstance(v, LoadedTextGen)]

    def generation_totals(self) -> GenerationStats:
        """Generation counters summed over engines, past ones included."""
        totals = replace(self._generation_retired)
        for engine in self.engines():
            totals.add(engine.stats)
        return totals
