"""Per-arm and per-model traffic numbers, summed from the gateways' ``TrafficSample`` rows.

Guardrails, approval evidence, the API and the web UI's live charts all read them from here.
Samples are counted per version, so an arm's numbers are its version's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Sum
from django.utils import timezone

from gateway.models import TrafficSample
from gateway.traffic import LATENCY_BOUNDS_MS, percentile_ms

from .models import RolloutPlan
from .strategies import STRATEGIES

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


def _sum_buckets(rows) -> tuple[int, ...]:
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


def plan_arms(plan: RolloutPlan) -> list[tuple[str, int, float]]:
    """(arm name, version id, weight) of every arm, plus the shadow candidate at weight 0."""
    strategy = STRATEGIES[plan.mode]
    arms = [(a.name, a.version_id, a.weight) for a in strategy.arms(plan)]
    shadow = strategy.shadow(plan)
    if shadow is not None:
        arms.append(("shadow", shadow[0], 0.0))
    return arms


def plan_arm_metrics(plan: RolloutPlan, since: datetime | None = None) -> list[dict]:
    """Each arm's numbers since ``since`` (default: since the plan started)."""
    since = since or plan.created_at
    versions = dict(plan.model.versions.values_list("pk", "version"))
    return [
        {"arm": name, "version": versions.get(vid), "weight": weight}
        | arm_stats(vid, since).as_dict()
        for name, vid, weight in plan_arms(plan)
    ]


def metrics_diff(arms: list[dict]) -> dict | None:
    """Candidate minus baseline for the numbers an approver compares (canary and shadow)."""
    by_name = {a["arm"]: a for a in arms}
    base = by_name.get("baseline")
    cand = by_name.get("candidate") or by_name.get("shadow")
    if base is None or cand is None:
        return None
    diff = {}
    for key in ("error_rate", "p50_ms", "p95_ms", "p99_ms"):
        if base[key] is not None and cand[key] is not None:
            diff[key] = round(cand[key] - base[key], 6)
    return diff


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
