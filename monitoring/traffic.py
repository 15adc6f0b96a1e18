"""Per-version request outcomes: counted in process by each gateway (a few integer additions
per request), flushed as ``TrafficSample`` rows by its refresh loop (one bulk insert, off the
request path), and summed over windows (``ArmStats``) for guardrails, evidence, SLOs and charts.

Counts are kept per (version, plan, arm): an A/B plan's arms are measured apart even when two
arms serve one version. Two latency histograms are kept: the coarse 1-2-5 one that the SLOs
read in SQL and the charts show, and a fine, sparse one (buckets about 5 % wide) from which the
guardrails bound a quantile (see ``rollouts.stats``) without the coarse one's 2.5x steps.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Sum
from django.utils import timezone

from .models import TrafficSample

# Upper bounds (ms) of the latency histogram buckets; the last bucket is open-ended.
LATENCY_BOUNDS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

# The fine histogram: bucket i holds latencies in [fine_lower_ms(i), fine_lower_ms(i + 1)), with
# edges FINE_BASE_MS * (FINE_RATIO ** i - 1): about 5 % wide above a millisecond, and one log,
# one multiply and one int() per request (no search, no branch: 0 ms lands in bucket 0). In
# process it is a list (an index is cheaper than a dict's get and set); FINE_SLOTS buckets reach
# past ten years, so no latency a perf_counter difference can give falls outside.
FINE_RATIO = 1.05
FINE_BASE_MS = 0.01
FINE_SLOTS = 640
_FINE_PER_MS = 1 / FINE_BASE_MS
_FINE_PER_LOG = 1 / math.log(FINE_RATIO)


def fine_index(ms: float) -> int:
    return int(math.log(ms * _FINE_PER_MS + 1.0) * _FINE_PER_LOG)


def fine_lower_ms(index: int) -> float:
    """The lower edge of fine bucket ``index`` (the upper edge is ``fine_lower_ms(index + 1)``)."""
    return FINE_BASE_MS * (FINE_RATIO**index - 1.0)


# Who routed a request: (plan id, arm name), or NO_PLAN when no rollout plan did.
PlanArmKey = tuple[int | None, str]
NO_PLAN: PlanArmKey = (None, "")


@dataclass
class Counts:
    requests: int = 0
    errors: int = 0
    degraded: int = 0  # errors a lower step of the model's fallback ladder answered
    not_ready: int = 0  # refused before any replica was ready: not requests, not errors
    # Usage: rows of the requests answered (their batch dimension), generation tokens.
    rows: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_MS) + 1))
    fine_slots: list[int] = field(default_factory=lambda: [0] * FINE_SLOTS)

    def add(self, seconds: float, ok: bool) -> None:
        self.requests += 1
        if not ok:
            self.errors += 1
        ms = seconds * 1000
        self.buckets[bisect.bisect_left(LATENCY_BOUNDS_MS, ms)] += 1
        self.fine_slots[int(math.log(ms * _FINE_PER_MS + 1.0) * _FINE_PER_LOG)] += 1

    @property
    def fine(self) -> dict[int, int]:
        """The fine histogram, sparse ({index: count}), as ``TrafficSample.latency_fine``."""
        return {i: count for i, count in enumerate(self.fine_slots) if count}


# (version id, (plan id, arm))
CounterKey = tuple[int, PlanArmKey]


class TrafficCounter:
    def __init__(self) -> None:
        self._counts: dict[CounterKey, Counts] = {}

    def _for(self, version_id: int, counted: PlanArmKey) -> Counts:
        key = (version_id, counted)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = Counts()
        return counts

    def record(
        self,
        version_id: int,
        seconds: float,
        ok: bool,
        counted: PlanArmKey = NO_PLAN,
        rows: int = 0,
    ) -> None:
        """Count one request of the version, for the plan and arm that routed it (``counted``:
        one tuple the caller already holds, so the key costs no unpacking), and the ``rows``
        it was answered for (0 when it was not answered)."""
        counts = self._for(version_id, counted)
        counts.add(seconds, ok)
        counts.rows += rows

    def tokens(
        self, version_id: int, tokens_in: int, tokens_out: int, counted: PlanArmKey = NO_PLAN
    ) -> None:
        """Count a generation's prompt and generated tokens (when its stream closes)."""
        counts = self._for(version_id, counted)
        counts.tokens_in += tokens_in
        counts.tokens_out += tokens_out

    def not_ready(self, version_id: int, counted: PlanArmKey = NO_PLAN) -> None:
        """A request refused because no replica of the version was ready yet."""
        self._for(version_id, counted).not_ready += 1

    def degrade(self, version_id: int, counted: PlanArmKey = NO_PLAN) -> None:
        """The version's last failed request was answered by its model's fallback ladder."""
        self._for(version_id, counted).degraded += 1

    def drain(self) -> dict[CounterKey, Counts]:
        counts, self._counts = self._counts, {}
        return counts


def save_samples(counts: dict[CounterKey, Counts]) -> None:
    now = timezone.now()
    TrafficSample.objects.bulk_create(
        TrafficSample(
            version_id=vid,
            plan_id=plan_id,
            arm=arm or "",
            window_end=now,
            requests=c.requests,
            errors=c.errors,
            degraded=c.degraded,
            not_ready=c.not_ready,
            latency_buckets=c.buckets,
            latency_fine=c.fine,
            rows=c.rows,
            tokens_in=c.tokens_in,
            tokens_out=c.tokens_out,
        )
        for (vid, (plan_id, arm)), c in counts.items()
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
    # {fine bucket index: count}; empty for rows written before the fine histogram existed.
    fine: Mapping[int, int] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def percentile_ms(self, q: float) -> float:
        return percentile_ms(list(self.buckets), q)

    @property
    def p99_ms(self) -> float:
        return self.percentile_ms(0.99)

    def as_dict(self) -> dict[str, Any]:
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


def sum_fine(rows: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """Sum sparse fine histograms (JSON turns their keys into strings)."""
    total: dict[int, int] = {}
    for sample in rows:
        for index, count in (sample or {}).items():
            i = int(index)
            total[i] = total.get(i, 0) + int(count)
    return total


def arm_stats(
    version_id: int | None,
    since: datetime,
    until: datetime | None = None,
    *,
    plan_arm: PlanArmKey | None = None,
) -> ArmStats:
    """One arm's numbers since ``since``: a version's (every request it answered), or with
    ``plan_arm`` (plan id, arm name) only the requests that plan routed to that arm."""
    rows = TrafficSample.objects.filter(window_end__gte=since)
    if version_id is not None:
        rows = rows.filter(version_id=version_id)
    if plan_arm is not None:
        rows = rows.filter(plan_id=plan_arm[0], arm=plan_arm[1])
    if until is not None:
        rows = rows.filter(window_end__lt=until)
    requests = errors = 0
    coarse, fine = [], []
    for n, e, buckets, fine_buckets in rows.values_list(
        "requests", "errors", "latency_buckets", "latency_fine"
    ):
        requests += n
        errors += e
        coarse.append(buckets)
        fine.append(fine_buckets)
    return ArmStats(requests, errors, _sum_buckets(coarse), sum_fine(fine))


def timeseries(
    version_ids: dict[str, int],
    minutes: int = 15,
    step_s: int = 10,
    *,
    plan_id: int | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Per arm, one point per ``step_s``: requests/s, error rate and p99 over that step. With
    ``plan_id``, each arm's own requests under that plan (an A/B plan's arms may share a
    version); without, the versions' requests."""
    now = timezone.now()
    start = now - timedelta(minutes=minutes)
    rows = TrafficSample.objects.filter(window_end__gte=start)
    keys: dict[str, int | str]  # arm name -> what its rows are grouped by
    if plan_id is None:
        rows = rows.filter(version_id__in=set(version_ids.values()))
        key_field, keys = "version_id", dict(version_ids)
    else:
        rows = rows.filter(plan_id=plan_id, arm__in=list(version_ids))
        key_field, keys = "arm", {name: name for name in version_ids}
    values = rows.values_list(key_field, "window_end", "requests", "errors", "latency_buckets")
    slots: dict[tuple[int | str, int], list[Any]] = {}
    for vid, end, requests, errors, buckets in values:
        slot = int((end - start).total_seconds() // step_s)
        acc = slots.setdefault((vid, slot), [0, 0, []])
        acc[0] += requests
        acc[1] += errors
        acc[2].append(buckets)
    series: dict[str, list[dict[str, Any]]] = {}
    for name, vid in keys.items():
        points = []
        for (v, slot), (requests, errors, hist) in sorted(slots.items(), key=lambda s: s[0][1]):
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


def versions_summary(version_ids: list[int], window_s: int = 60) -> dict[str, Any]:
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
