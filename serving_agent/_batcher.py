"""Dynamic batching and scheduling: per version, queues by priority class and caller, requests
merged along axis 0 into model runs."""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ._compute import ComputeMeter, RunTotals
from ._exceptions import BadInput, Cancelled, Expired, NotLoaded, Overloaded, OverShare
from ._runtime import Runtime, check_output_rows
from .protocol import BATCH_SIZE_BOUNDS, INTERACTIVE, PRIORITY_CLASSES, SHADOW

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


# Shadow copies may hold at most this fraction of a version's queue: they are the platform's
# own extra work and must never crowd out a caller's requests.
SHADOW_SHARE = 8

# Requests can be concatenated only when all their non-batch dims and dtypes agree.
_Key = tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass
class SchedCounts:
    """What the scheduler dropped, since the agent started (agents pass one object shared by
    all their batchers, so the counts outlive an unloaded version; heartbeats report them)."""

    expired: int = 0  # past their deadline before compute
    cancelled: int = 0  # their caller gave up while they were queued
    shed: int = 0  # refused or evicted for load (caller share, shadow cap, full queue)


class RowsFailed(Exception):
    """A group's run in which some rows failed on their own (a python package's ``Partial``):
    the outputs of every row, and why each failed row failed (rows counted from the group's
    first), for the group's members to be answered one by one."""

    def __init__(
        self,
        outputs: list[np.ndarray],
        row_errors: dict[int, str],
        queue_s: float,
        compute_s: float,
    ) -> None:
        super().__init__(f"{len(row_errors)} rows failed")
        self.outputs = outputs
        self.names: list[str] = []
        self.row_errors = row_errors
        self.queue_s = queue_s
        self.compute_s = compute_s


@dataclass(slots=True, eq=False)
class _Pending:
    inputs: dict[str, np.ndarray]
    rows: int
    key: _Key
    future: asyncio.Future[list[np.ndarray]]
    queued: float = 0.0  # perf_counter() when it was queued
    queue_s: float = 0.0  # set when its batch runs: waited, and the run's duration
    compute_s: float = 0.0
    caller: Hashable = 0  # the fairness unit: (tenant id, API key id) from the frame
    priority: int = INTERACTIVE
    deadline: float = math.inf  # time.monotonic() past which it is not worth computing
    request_id: int | None = None
    in_queue: bool = False
    # The requests it holds: 1, or a group frame's members (its rows are theirs, in order).
    # Queue depth, caller shares and shadow caps count requests, not entries.
    weight: int = 1
    row_errors: dict[int, str] | None = None  # a group's rows that failed on their own


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

    Scheduling: one queue per priority class, served strictly best class first; inside a
    class, one queue per caller (a tenant's API key), taken round-robin, so a flooding caller
    gets its turn and not the whole queue. While another caller has work here, a caller may
    hold at most ``max_queue_per_caller`` requests queued or running (alone it may use the
    whole queue: nobody is waiting for the room). Shadow copies hold at most 1/SHADOW_SHARE of
    the queue. A full queue evicts the newest request of the worst class queued below the
    newcomer's, or else of the caller holding most in the newcomer's class, before it refuses
    the newcomer.
    A request met past its deadline is dropped, never computed.
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_batch_size: int = 32,
        max_queue_delay_ms: float = 0.0,
        max_queue: int = 256,
        max_queue_per_caller: int = 0,
        inline: bool = False,
        batch_sizes: BatchSizes | None = None,
        counts: SchedCounts | None = None,
        meter: ComputeMeter | None = None,
    ) -> None:
        self.runtime = runtime
        # This version's compute (the heartbeat's *_total fields), measured by the agent's
        # one meter, which splits CPU time between the runs of every version in progress.
        self.totals = RunTotals()
        self.meter = meter if meter is not None else ComputeMeter()
        self._provider = getattr(runtime, "provider", "")  # test fakes may name none
        self.max_batch_size = max_batch_size
        self.max_queue_delay_ms = max_queue_delay_ms
        self.max_queue = max_queue
        self.max_queue_per_caller = max_queue_per_caller  # 0: half of max_queue
        self.inline = inline
        self.runs = 0
        # Rows per run, counted per bucket of BATCH_SIZE_BOUNDS; agents pass one list shared by
        # all their batchers, so the counts outlive an unloaded version.
        self.batch_sizes = batch_sizes if batch_sizes is not None else BatchSizes()
        self.counts = counts if counts is not None else SchedCounts()
        # Per class, caller -> its queued requests; a dict's order is the round-robin turn.
        self._queues: list[dict[Hashable, deque[_Pending]]] = [{} for _ in PRIORITY_CLASSES]
        self._class_depth = [0] * len(PRIORITY_CLASSES)
        self._depth = 0
        self._caller_load: dict[Hashable, int] = {}  # requests queued or running, per caller
        self._by_id: dict[int, _Pending] = {}  # queued requests that a cancel frame may name
        self._wakeup = asyncio.Event()
        self._running: list[_Pending] = []
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        # One thread per version: its batches run one at a time, other versions in parallel.
        self._executor = None if inline else ThreadPoolExecutor(1, thread_name_prefix="batcher")

    @property
    def depth(self) -> int:
        """Requests waiting for a batch (not counting the one running)."""
        return self._depth

    @property
    def caller_cap(self) -> int:
        return self.max_queue_per_caller or max(1, self.max_queue // 2)

    @property
    def shadow_cap(self) -> int:
        return max(1, self.max_queue // SHADOW_SHARE)

    async def infer(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Queue one request and wait for its outputs (rows of the batch it ran in)."""
        outputs, _, _ = await self.infer_timed(inputs)
        return outputs

    async def infer_timed(
        self,
        inputs: dict[str, np.ndarray],
        *,
        caller: Hashable = 0,
        priority: int = INTERACTIVE,
        deadline: float = math.inf,
        request_id: int | None = None,
        weight: int = 1,
    ) -> tuple[list[np.ndarray], float, float]:
        """``infer``, plus the seconds it waited for its batch and the seconds the run took.

        ``deadline`` is a ``time.monotonic()`` time; ``request_id`` lets ``cancel`` find it.
        ``weight`` > 1: the inputs are a group of that many requests, queued and run as one
        entry (``RowsFailed`` when some of their rows failed on their own).
        """
        if self._stopped:
            raise NotLoaded("version unloaded")
        rows = request_rows(inputs)
        key = tuple(sorted((n, a.shape[1:], a.dtype.str) for n, a in inputs.items()))
        future: asyncio.Future[list[np.ndarray]] = asyncio.get_running_loop().create_future()
        pending = _Pending(
            inputs, rows, key, future, time.perf_counter(), caller=caller, priority=priority
        )
        pending.deadline = deadline
        pending.weight = weight
        self._admit(pending)
        if request_id is not None:
            pending.request_id = request_id
            self._by_id[request_id] = pending
        self._enqueue(pending)
        self._caller_load[caller] = self._caller_load.get(caller, 0) + weight
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="batcher")
        try:
            outputs = await future
        finally:
            load = self._caller_load[caller] - weight
            if load:
                self._caller_load[caller] = load
            else:
                del self._caller_load[caller]
            if pending.in_queue:  # its caller was cancelled while it waited
                self._unlink(pending)
        if pending.row_errors:
            raise RowsFailed(outputs, pending.row_errors, pending.queue_s, pending.compute_s)
        return outputs, pending.queue_s, pending.compute_s

    def cancel(self, request_id: int) -> bool:
        """Remove a queued request whose caller gave up; it is answered ``Cancelled`` and never
        computed. False when it is not queued here (unknown, running or done)."""
        pending = self._by_id.get(request_id)
        if pending is None:
            return False
        self._unlink(pending)
        self.counts.cancelled += 1
        pending.future.set_exception(Cancelled("the caller gave up before it ran"))
        return True

    def _admit(self, p: _Pending) -> None:
        """Make room for ``p`` or raise why it is refused (expired, capped, or queue full)."""
        if p.deadline <= time.monotonic():
            self.counts.expired += 1
            raise Expired("the request's deadline passed before it reached the model")
        if p.priority == SHADOW and self._class_depth[SHADOW] + p.weight > self.shadow_cap:
            self.counts.shed += 1
            raise Overloaded(f"shadow copies are capped at {self.shadow_cap} queued requests")
        held = self._caller_load.get(p.caller, 0)
        if held + p.weight > self.caller_cap and len(self._caller_load) > 1:
            self.counts.shed += 1
            raise OverShare(
                f"this API key holds {held} requests on a version other callers share "
                f"(at most {self.caller_cap}); slow down and retry"
            )
        while self._depth and self._depth + p.weight > self.max_queue:
            victim, error = self._victim(p)
            self.counts.shed += 1
            if victim is None:
                raise error
            self._unlink(victim)
            victim.future.set_exception(error)

    def _victim(self, p: _Pending) -> tuple[_Pending | None, Overloaded]:
        """What a full queue gives up for ``p``: the newest request of the worst class below
        ``p``'s, else the newest of the caller holding most of ``p``'s class when that is more
        than ``p``'s caller holds; None (and ``p`` is refused) when ``p`` is the least worthy."""
        for cls in range(len(PRIORITY_CLASSES) - 1, p.priority, -1):
            queues = self._queues[cls]
            if queues:
                caller = max(queues, key=lambda t: len(queues[t]))
                return queues[caller][-1], Overloaded(
                    f"shed for {PRIORITY_CLASSES[p.priority]} work: the queue is full"
                )
        queues = self._queues[p.priority]
        if queues:
            caller = max(queues, key=lambda t: self._caller_load.get(t, 0))
            if self._caller_load.get(caller, 0) > self._caller_load.get(p.caller, 0) + 1:
                return queues[caller][-1], OverShare(
                    "shed for another caller: this API key held most of a full queue"
                )
        mine = self._caller_load.get(p.caller, 0)
        if len(self._caller_load) > 1 and mine >= max(self._caller_load.values()):
            # The newcomer's own caller holds most of the queue: it is the one to slow down.
            return None, OverShare(
                f"queue full ({self.max_queue} requests waiting), most of them this API key's"
            )
        return None, Overloaded(f"queue full ({self.max_queue} requests waiting)")

    def _enqueue(self, p: _Pending) -> None:
        queues = self._queues[p.priority]
        queue = queues.get(p.caller)
        if queue is None:
            queue = queues[p.caller] = deque()
        queue.append(p)
        p.in_queue = True
        self._class_depth[p.priority] += p.weight
        self._depth += p.weight

    def _unlink(self, p: _Pending) -> None:
        """Take a queued request out of its queue (nothing when it is not queued)."""
        if not p.in_queue:
            return
        queues = self._queues[p.priority]
        queue = queues[p.caller]
        queue.remove(p)
        if not queue:
            del queues[p.caller]
        self._forget(p)

    def _forget(self, p: _Pending) -> None:
        p.in_queue = False
        self._class_depth[p.priority] -= p.weight
        self._depth -= p.weight
        if p.request_id is not None:
            self._by_id.pop(p.request_id, None)

    def _head(self) -> _Pending | None:
        """The request whose turn is next: best class first, callers in turn inside it."""
        if not self._depth:
            return None
        for queues in self._queues:
            for queue in queues.values():
                return queue[0]
        return None

    def _pop(self, p: _Pending) -> None:
        """Take the head ``p`` and move its caller to the back of its class's turn."""
        queues = self._queues[p.priority]
        queue = queues.pop(p.caller)
        queue.popleft()
        if queue:
            queues[p.caller] = queue
        self._forget(p)

    async def stop(self, reason: str = "version unloaded") -> None:
        """Stop batching; every request still waiting or running fails with ``not_loaded``."""
        self._stopped = True
        queued = [p for queues in self._queues for q in queues.values() for p in q]
        stranded = [*self._running, *queued]  # read before cancelling clears _running
        for p in queued:
            p.in_queue = False
        for queues in self._queues:
            queues.clear()
        self._class_depth = [0] * len(PRIORITY_CLASSES)
        self._depth = 0
        self._by_id.clear()
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
            while not self._depth:
                self._wakeup.clear()
                await self._wakeup.wait()
            rows = self._take(batch, rows)
        if self.max_queue_delay_ms <= 0:
            return batch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_queue_delay_ms / 1000
        while rows < self.max_batch_size:
            if self._depth:
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
        """Move queued requests into ``batch`` in turn while they fit; returns the batch's
        rows. A request past its deadline is answered ``Expired`` here instead."""
        now = time.monotonic()
        while (p := self._head()) is not None:
            if p.future.done():  # its caller gave up (cancelled); nothing to compute
                self._pop(p)
                continue
            if p.deadline <= now:
                self._pop(p)
                self.counts.expired += 1
                p.future.set_exception(Expired("the request's deadline passed in the queue"))
                continue
            if batch and rows + p.rows > self.max_batch_size:
                break  # an oversized request still runs, alone
            self._pop(p)
            batch.append(p)
            rows += p.rows
        return rows

    async def run_batch(self, group: list[_Pending]) -> None:
        """Run one concatenated batch and split its outputs back; a failure fails every future."""
        rows = sum(p.rows for p in group)
        self._running = group
        started = time.perf_counter()
        self.totals.queue_wait_s += sum(started - p.queued for p in group)
        try:
            feed = concatenate(group)
            self.runs += 1
            self.batch_sizes.add(rows)
            run_started = self.meter.start(self.totals)
            try:
                if self._executor is None:
                    outputs = self.runtime.run(feed)
                else:
                    loop = asyncio.get_running_loop()
                    outputs = await loop.run_in_executor(self._executor, self.runtime.run, feed)
            finally:
                self.meter.stop(self.totals, run_started, rows, self._provider)
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
        # Rows the model failed on their own (a python package's ``Partial``): the requests
        # holding them fail, the others get their rows.
        row_errors: dict[int, str] = getattr(outputs, "row_errors", {})
        start = 0
        for p in group:
            p.queue_s, p.compute_s = started - p.queued, ended - started
            failed = [row_errors[r] for r in range(start, start + p.rows) if r in row_errors]
            if p.future.done():
                pass
            elif failed and p.weight > 1:  # the group's members are answered one by one
                p.row_errors = {
                    r - start: row_errors[r]
                    for r in range(start, start + p.rows)
                    if r in row_errors
                }
                p.future.set_result([out[start : start + p.rows] for out in outputs])
            elif failed:
                p.future.set_exception(BadInput(f"the model refused this input: {failed[0]}"))
            else:
                p.future.set_result([out[start : start + p.rows] for out in outputs])
            start += p.rows
