"""What each loaded version's model runs cost: CPU-seconds, accelerator-seconds, runs, rows,
run time and queue wait, totalled per version for the heartbeat (usage, chargeback and
right-sizing take the deltas between heartbeats).

How CPU time is measured: the process's CPU clock (``time.process_time``: every thread of the
process, so ONNX Runtime's intra-op pool and torch's threads are in it, which a per-thread
clock of the calling thread would miss) is read whenever a run starts or ends, and the CPU
time between two readings is split evenly between the runs in progress then. A run alone (the
usual case: one run at a time per version, and one version busy) is charged exactly the CPU
time the process spent while it ran. What the event loop spends meanwhile (reading frames,
sending replies) is charged to the runs too: it is the cost of serving them. CPU time spent
while no run is in progress (idle spinning of the runtime's pool after a run, heartbeats) is
charged to nobody.

Accelerator-seconds are the wall time of runs on a CUDA provider (0 on CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# The providers whose runs occupy an accelerator (ONNX Runtime's, and the torch engines').
ACCEL_PROVIDERS = frozenset({"CUDAExecutionProvider", "torch-cuda"})


@dataclass(eq=False)  # runs in progress are told apart by identity
class RunTotals:
    """One version's totals since it loaded (``VersionLoad``'s ``*_total`` fields)."""

    cpu_s: float = 0.0
    accel_s: float = 0.0
    runs: int = 0
    rows: int = 0
    run_s: float = 0.0
    queue_wait_s: float = 0.0


class ComputeMeter:
    """Splits the process's CPU time between the model runs in progress (one per agent, shared
    by every version's batcher and engine). Called on the event loop only: runs start and
    end there, around the await of their worker thread, so it needs no lock."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self._clock = clock
        self._last = clock()
        self._active: list[RunTotals] = []  # one entry per run in progress

    def _advance(self) -> None:
        now = self._clock()
        spent, self._last = now - self._last, now
        if self._active and spent > 0:
            share = spent / len(self._active)
            for totals in self._active:
                totals.cpu_s += share

    def start(self, totals: RunTotals) -> float:
        """A run of the version whose totals are ``totals`` begins; returns its start time
        for ``stop``. (Two calls rather than a context manager: measured 1.5 us against
        3.6 us per run, which counts for models that run inline in 100 us.)"""
        self._advance()
        self._active.append(totals)
        return time.perf_counter()

    def stop(self, totals: RunTotals, started: float, rows: int, provider: str) -> None:
        """The run ends, with ``rows`` rows; counted whether it succeeded or failed (its
        compute was spent either way)."""
        wall = time.perf_counter() - started
        self._advance()
        self._active.remove(totals)
        totals.runs += 1
        totals.rows += rows
        totals.run_s += wall
        if provider in ACCEL_PROVIDERS:
            totals.accel_s += wall
