"""Per-version request outcomes counted in process and flushed as ``TrafficSample`` rows.

Counting is a few integer additions per request; the flush (one bulk insert) runs in the
gateway's refresh loop, off the request path.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from django.utils import timezone

from .models import TrafficSample

# Upper bounds (ms) of the latency histogram buckets; the last bucket is open-ended.
LATENCY_BOUNDS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass
class Counts:
    requests: int = 0
    errors: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_MS) + 1))

    def add(self, seconds: float, ok: bool) -> None:
        self.requests += 1
        if not ok:
            self.errors += 1
        self.buckets[bisect.bisect_left(LATENCY_BOUNDS_MS, seconds * 1000)] += 1


class TrafficCounter:
    def __init__(self) -> None:
        self._counts: dict[int, Counts] = {}

    def record(self, version_id: int, seconds: float, ok: bool) -> None:
        counts = self._counts.get(version_id)
        if counts is None:
            counts = self._counts[version_id] = Counts()
        counts.add(seconds, ok)

    def drain(self) -> dict[int, Counts]:
        counts, self._counts = self._counts, {}
        return counts


def save_samples(counts: dict[int, Counts]) -> None:
    now = timezone.now()
    TrafficSample.objects.bulk_create(
        TrafficSample(
            version_id=vid,
            window_end=now,
            requests=c.requests,
            errors=c.errors,
            latency_buckets=c.buckets,
        )
        for vid, c in counts.items()
    )


def percentile_ms(buckets: list[int], q: float) -> float:
    """The upper bound of the bucket holding the q-quantile (infinity for the open bucket)."""
    total = sum(buckets)
    if total == 0:
        return 0.0
    rank = q * total
    running = 0
    for i, count in enumerate(buckets):
        running += count
        if running >= rank:
            return LATENCY_BOUNDS_MS[i] if i < len(LATENCY_BOUNDS_MS) else float("inf")
    return float("inf")
