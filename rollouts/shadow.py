"""Shadow comparisons: gateways count them in process and record them here in bulk."""

from __future__ import annotations

from typing import Any

from django.db.models import Sum
from django.utils import timezone

from .models import RolloutPlan, ShadowSample


def record_shadow(stats: dict[int, list[int]]) -> None:
    """Write {plan id: [answered, agreed, failed]} gathered since the last flush."""
    now = timezone.now()
    live = set(RolloutPlan.objects.filter(pk__in=stats).values_list("pk", flat=True))
    ShadowSample.objects.bulk_create(
        ShadowSample(plan_id=pid, window_end=now, answered=a, agreed=g, failed=f)
        for pid, (a, g, f) in stats.items()
        if pid in live
    )


def shadow_summary(plan: RolloutPlan) -> dict[str, Any]:
    totals = plan.shadow_samples.aggregate(
        answered=Sum("answered"), agreed=Sum("agreed"), failed=Sum("failed")
    )
    answered = totals["answered"] or 0
    return {
        "answered": answered,
        "agreed": totals["agreed"] or 0,
        "failed": totals["failed"] or 0,
        "agreement_rate": (totals["agreed"] or 0) / answered if answered else None,
    }
