"""CPU cost per request of counting a request's outcome for the guardrails
(``monitoring.traffic.TrafficCounter.record``, on the gateway's hot path): the former counter
(per version, the coarse 1-2-5 histogram only) against the current one (per version, plan and
arm, plus the fine log-spaced histogram the p99 test reads).

    .venv/bin/python bench/traffic_record_cost.py

Prints a Markdown table of CPU ns per request, less the bare loop's (best of 7 interleaved
runs of 500,000 requests each).
"""

from __future__ import annotations

import bisect
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")

import django  # noqa: E402

django.setup()

from monitoring.traffic import LATENCY_BOUNDS_MS, TrafficCounter  # noqa: E402

N = 500_000
RUNS = 7


class FormerCounts:
    """The counter before the fine histogram (kept here as the baseline of the comparison)."""

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.buckets = [0] * (len(LATENCY_BOUNDS_MS) + 1)

    def add(self, seconds: float, ok: bool) -> None:
        self.requests += 1
        if not ok:
            self.errors += 1
        self.buckets[bisect.bisect_left(LATENCY_BOUNDS_MS, seconds * 1000)] += 1


class FormerCounter:
    def __init__(self) -> None:
        self._counts: dict[int, FormerCounts] = {}

    def record(self, version_id: int, seconds: float, ok: bool) -> None:
        counts = self._counts.get(version_id)
        if counts is None:
            counts = self._counts[version_id] = FormerCounts()
        counts.add(seconds, ok)


def cpu_ns(run: Callable[[list[float]], None], latencies: list[float]) -> float:
    # CPU time, not wall time: on a shared, loaded box waiting for a core is not the cost.
    started = time.process_time_ns()
    run(latencies)
    return (time.process_time_ns() - started) / len(latencies)


def loop_only(latencies: list[float]) -> None:
    for _seconds in latencies:
        pass


def former(latencies: list[float]) -> None:
    record = FormerCounter().record
    for seconds in latencies:
        record(7, seconds, True)


def current_no_plan(latencies: list[float]) -> None:
    record = TrafficCounter().record
    for seconds in latencies:
        record(7, seconds, True)


def current_plan_arm(latencies: list[float]) -> None:
    record = TrafficCounter().record
    counted = (12, "candidate")
    for seconds in latencies:
        record(7, seconds, True, counted)


def main() -> None:
    rng = random.Random(1)
    latencies = [rng.lognormvariate(1.5, 0.6) / 1000 for _ in range(N)]  # a few ms
    variants = {
        "former: per version, coarse histogram": former,
        "current, no plan: + fine histogram": current_no_plan,
        "current, plan and arm: + fine histogram": current_plan_arm,
    }
    best = dict.fromkeys([*variants, "loop"], float("inf"))
    for _ in range(RUNS):  # interleaved, so every variant sees the same conditions
        best["loop"] = min(best["loop"], cpu_ns(loop_only, latencies))
        for name, run in variants.items():
            best[name] = min(best[name], cpu_ns(run, latencies))
    rows = [(name, best[name] - best["loop"]) for name in variants]
    print("| record() | ns per request |")
    print("| --- | --- |")
    for name, ns in rows:
        print(f"| {name} | {ns:.0f} |")


if __name__ == "__main__":
    main()
