"""Dynamic batching: one queue per version, requests merged along axis 0 into model runs."""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ._exceptions import BadInput, NotLoaded, Overloaded
from ._runtime import Runtime, check_output_rows
from .protocol import BATCH_SIZE_BOUNDS

logger = logging.getLogger(__name__)

# Models faster than this at batch 1 run on the event loop: a hop to a worker thread and back
# costs ~70-110 us, more than such a model's whole run.
INLINE_BELOW_S = 0.0003


@dataclass
class BatchSizes:
    """Rows per model run: counts per bucket of BATCH_SIZE_BOUNDS (the last is open-ended)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BATCH_SIZE_BOUNDS) + 1))
    rows_total: int = 0

    def add(self, rows: int) -> None:
        self.counts[bisect.bisect_left(BATCH_SIZE_BOUNDS, rows)] += 1
        self.rows_total += rows


# Requests can be concatenated only when all their non-batch dims and dtypes agree.
_Key = tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass(slots=True, eq=False)
class _Pending:
    inputs: dict[str, np.ndarray]
    rows: int
    key: _Key
    future: asyncio.Future[list[np.ndarray]]
    queued: float = 0.0  # perf_counter() when it was queued
    queue_s: float = 0.0  # set when its batch runs: waited, and the run's duration
    compute_s: float = 0.0


def request_rows(inputs: dict[str, np.ndarray]) -> int:
    """The rows a request adds to a batch; all of its inputs must share that first dim."""
    rows = {a.shape[0] if a.ndim else -1 for a in inputs.values()}
    if len(rows) != 1 or min(rows) < 1:
        raise BadInput("every input needs the same batch dimension, of at least one row")
    return rows.pop()


def compatible_groups(batch: list[_Pending]) -> list[list[_Pending]]:
    """Split a batch into runs of concatenable requests, keeping arrival order within each."""
    groups: dict[_Key, list[_Pending]] = {}
    for p in batch:
        groups.setdefault(p.key, []).append(p)
    return list(groups.values())


def concatenate(group: list[_Pending]) -> dict[str, np.ndarray]:
    if len(group) == 1:
        return group[0].inputs  # the common light-load case: no copy
    return {name: np.concatenate([p.inputs[name] for p in group]) for name in group[0].inputs}


class Batcher:
    """Queues requests for one runtime and runs them in batches, one future per request.

    With ``max_queue_delay_ms == 0`` a lone request runs at once; requests that arrive while a
    batch runs form the next one. A delay > 0 trades that much latency for fuller batches.
    ``max_batch_size`` caps the rows merged into one run; a single request with more rows than
    that runs alone rather than being refused.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_batch_size: int = 32,
        max_queue_delay_ms: float = 0.0,
        max_queue: int = 256,
        inline: bool = False,
        batch_sizes: BatchSizes | None = None,
    ) -> None:
        self.runtime = runtime
        self.max_batch_size = max_batch_size
        self.max_queue_delay_ms = max_queue_delay_ms
        self.max_queue = max_queue
        self.inline = inline
        self.runs = 0
        # Rows per run, counted per bucket of BATCH_SIZE_BOUNDS; agents pass one list shared by
        # all their batchers, so the counts outlive an unloaded version.
        self.batch_sizes = batch_sizes if batch_sizes is not None else BatchSizes()
        self._queue: deque[_Pending] = deque()
        self._wakeup = asyncio.Event()
        self._running: list[_Pending] = []
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        # One thread per version: its batches run one at a time, other versions in parallel.
        self._executor = None if inline else ThreadPoolExecutor(1, thread_name_prefix="batcher")

    @property
    def depth(self) -> int:
        """Requests waiting for a batch (not counting the one running)."""
        return len(self._queue)

    async def infer(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Queue one request and wait for its outputs (rows of the batch it ran in)."""
        outputs, _, _ = await self.infer_timed(inputs)
        return outputs

    async def infer_timed(
        self, inputs: dict[str, np.ndarray]
    ) -> tuple[list[np.ndarray], float, float]:
        """``infer``, plus the seconds it waited for its batch and the seconds the run took."""
        if self._stopped:
            raise NotLoaded("version unloaded")
        if len(self._queue) >= self.max_queue:
            raise Overloaded(f"queue full ({self.max_queue} requests waiting)")
        rows = request_rows(inputs)
        key = tuple(sorted((n, a.shape[1:], a.dtype.str) for n, a in inputs.items()))
        future: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
        pending = _Pending(inputs, rows, key, future, time.perf_counter())
        self._queue.append(pending)
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="batcher")
        outputs = await future
        return outputs, pending.queue_s, pending.compute_s

    async def stop(self, reason: str = "version unloaded") -> None:
        """Stop batching; every request still waiting or running fails with ``not_loaded``."""
        self._stopped = True
        stranded = [*self._running, *self._queue]  # read before cancelling clears _running
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for p in stranded:
            if not p.future.done():
                p.future.set_exception(NotLoaded(reason))
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    async def _loop(self) -> None:
        while True:
            batch = await self.next_batch()
            for group in compatible_groups(batch):
                await self.run_batch(group)
            # An inline run never yields; let replies go out and new requests queue up.
            await asyncio.sleep(0)

    async def next_batch(self) -> list[_Pending]:
        """Wait for the first request, take what is queued, then wait up to the delay for more."""
        batch: list[_Pending] = []
        rows = 0
        while not batch:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            rows = self._take(batch, rows)
        if self.max_queue_delay_ms <= 0:
            return batch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_queue_delay_ms / 1000
        while rows < self.max_batch_size:
            if self._queue:
                break  # the next request does not fit; it heads the next batch
            self._wakeup.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._wakeup.wait()
            except TimeoutError:
                break
            rows = self._take(batch, rows)
        return batch

    def _take(self, batch: list[_Pending], rows: int) -> int:
        """Move queued requests into ``batch`` while they fit; returns the batch's rows."""
        while self._queue:
            p = self._queue[0]
            if p.future.done():  # its caller gave up (cancelled); nothing to compute
                self._queue.popleft()
                continue
            if batch and rows + p.rows > self.max_batch_size:
                break  # an oversized request still runs, alone
            batch.append(self._queue.popleft())
            rows += p.rows
        return rows

    async def run_batch(self, group: list[_Pending]) -> None:
        """Run one concatenated batch and split its outputs back; a failure fails every future."""
        rows = sum(p.rows for p in group)
        self._running = group
        started = time.perf_counter()
        try:
            feed = concatenate(group)
            self.runs += 1
            self.batch_sizes.add(rows)
            if self._executor is None:
                outputs = self.runtime.run(feed)
            else:
                loop = asyncio.get_running_loop()
                outputs = await loop.run_in_executor(self._executor, self.runtime.run, feed)
            check_output_rows(outputs, rows)
        except Exception as exc:  # noqa: BLE001 - whatever failed, every caller must hear it
            if not isinstance(exc, BadInput):
                logger.warning("batch of %d requests failed: %s", len(group), exc)
            for p in group:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finally:
            self._running = []
        ended = time.perf_counter()
        start = 0
        for p in group:
            p.queue_s, p.compute_s = started - p.queued, ended - started
            if not p.future.done():
                p.future.set_result([out[start : start + p.rows] for out in outputs])
            start += p.rows
