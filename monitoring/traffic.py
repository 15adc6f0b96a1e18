"""Per-version request outcomes: counted in process by each gateway (a few integer additions
per request), flushed as ``TrafficSample`` rows by its refresh loop (one bulk insert, off the
request path), and summed over windows (``ArmStats``) for guardrails, evidence, SLOs and charts.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Sum
from django.utils import timezone

from .models import TrafficSample

# Upper bounds (ms) of the latency histogram buckets; the last bucket is open-ended.
LATENCY_BOUNDS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass
class Counts:
    requests: int = 0
    errors: int = 0
    degraded: int = 0  # errors a lower step of the model's fallback ladder answered
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

    def degrade(self, version_id: int) -> None:
        """The version's last failed request was answered by its model's fallback ladder."""
        counts = self._counts.get(version_id)
        if counts is None:
            counts = self._counts[version_id] = Counts()
        counts.degraded += 1

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
            degraded=c.degraded,
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


# Sums over windows -----------------------------------------------------------------------------

N_BUCKETS = len(LATENCY_BOUNDS_MS) + 1


@dataclass(frozen=True)
class ArmStats:
    requests: int
    errors: int
    buckets: tuple[int, ...]

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def percentile_ms(self, q: float) -> float:
        return percentile_ms(list(self.buckets), q)

    @property
    def p99_ms(self) -> float:
        return self.percentile_ms(0.99)

    def as_dict(self) -> dict:
        def finite(ms: float) -> float | None:
            # JSON has no infinity: the open-ended bucket reads as "above the last bound".
            return ms if ms != float("inf") else None

        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 6),
            "p50_ms": finite(self.percentile_ms(0.5)),
            "p95_ms": finite(self.percentile_ms(0.95)),
            "p99_ms": finite(self.p99_ms),
        }


def _sum_buckets(rows: Iterable[Sequence[int]]) -> tuple[int, ...]:
    buckets = [0] * N_BUCKETS
    for sample in rows:
        for i, count in enumerate(sample):
            buckets[i] += count
    return tuple(buckets)


def arm_stats(version_id: int, since: datetime, until: datetime | None = None) -> ArmStats:
    rows = TrafficSample.objects.filter(version_id=version_id, window_end__gte=since)
    if until is not None:
        rows = rows.filter(window_end__lt=until)
    totals = rows.aggregate(requests=Sum("requests"), errors=Sum("errors"))
    buckets = _sum_buckets(rows.values_list("latency_buckets", flat=True))
    return ArmStats(totals["requests"] or 0, totals["errors"] or 0, buckets)


def timeseries(
    version_ids: dict[str, int], minutes: int = 15, step_s: int = 10
) -> dict[str, list[dict]]:
    """Per arm, one point per ``step_s``: requests/s, error rate and p99 over that step."""
    now = timezone.now()
    start = now - timedelta(minutes=minutes)
    rows = TrafficSample.objects.filter(
        version_id__in=set(version_ids.values()), window_end__gte=start
    ).values_list("version_id", "window_end", "requests", "errors", "latency_buckets")
    slots: dict[tuple[int, int], list] = {}
    for vid, end, requests, errors, buckets in rows:
        slot = int((end - start).total_seconds() // step_s)
        acc = slots.setdefault((vid, slot), [0, 0, []])
        acc[0] += requests
        acc[1] += errors
        acc[2].append(buckets)
    series: dict[str, list[dict]] = {}
    for name, vid in version_ids.items():
        points = []
        for (v, slot), (requests, errors, hist) in sorted(slots.items()):
            if v != vid:
                continue
            stats = ArmStats(requests, errors, _sum_buckets(hist))
            p99 = stats.p99_ms
            points.append(
                {
                    "t": (start + timedelta(seconds=(slot + 1) * step_s)).isoformat(),
                    "rps": round(requests / step_s, 3),
                    "error_rate": round(stats.error_rate, 6),
                    "p99_ms": p99 if p99 != float("inf") else None,
                }
            )
        series[name] = points
    return series


def versions_summary(version_ids: list[int], window_s: int = 60) -> dict:
    """Request rate, error rate and p99 over the last ``window_s`` across these versions."""
    since = timezone.now() - timedelta(seconds=window_s)
    rows = TrafficSample.objects.filter(version_id__in=version_ids, window_end__gte=since)
    totals = rows.aggregate(requests=Sum("requests"), errors=Sum("errors"))
    stats = ArmStats(
        totals["requests"] or 0,
        totals["errors"] or 0,
        _sum_buckets(rows.values_list("latency_buckets", flat=True)),
    )
    return {"rps": round(stats.requests / window_s, 3)} | stats.as_dict()
