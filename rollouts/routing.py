"""Sticky, reproducible arm assignment: a hash of (plan, routing key) picks a bucket."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from .models import ACTIVE_STATES, RolloutPlan
from .strategies import STRATEGIES, Arm

BUCKETS = 10_000


def bucket(plan_id: int, key: str) -> int:
    """A stable bucket in [0, BUCKETS) for this key under this plan."""
    digest = hashlib.blake2b(f"{plan_id}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


@dataclass(frozen=True)
class Split:
    """A plan's traffic split, as cached by the gateway."""

    plan_id: int
    arms: tuple[Arm, ...]
    bounds: tuple[int, ...]  # upper bucket bound of each arm, cumulative
    routing_header: str
    shadow: tuple[int, float] | None

    def choose(self, key: str) -> Arm:
        point = bucket(self.plan_id, key)
        for arm, bound in zip(self.arms, self.bounds, strict=True):
            if point < bound:
                return arm
        return self.arms[-1]

    def shadow_for(self, key: str) -> int | None:
        """The shadow version this request is copied to, if it is in the sampled share."""
        if self.shadow is None:
            return None
        version_id, share = self.shadow
        # A second, independent hash so the shadow sample does not follow the arm split.
        return version_id if bucket(-self.plan_id, key) < share * BUCKETS else None


def split_of(plan: RolloutPlan) -> Split:
    strategy = STRATEGIES[plan.mode]
    arms = tuple(a for a in strategy.arms(plan) if a.weight > 0) or tuple(strategy.arms(plan)[:1])
    total = sum(a.weight for a in arms) or 1.0
    bounds, running = [], 0.0
    for arm in arms:
        running += arm.weight
        bounds.append(round(running / total * BUCKETS))
    return Split(plan.pk, arms, tuple(bounds), plan.routing_header.lower(), strategy.shadow(plan))


def active_split(tenant_id: int, model_name: str, alias: str) -> Split | None:
    plan = (
        RolloutPlan.objects.select_related("baseline", "candidate")
        .prefetch_related("arms")
        .filter(model__tenant_id=tenant_id, model__name=model_name, alias=alias)
        .filter(state__in=ACTIVE_STATES)
        .first()
    )
    return None if plan is None else split_of(plan)


# A plan that just ended keeps its versions assigned this long, so requests already routed to
# the candidate finish and every gateway has switched before agents unload it.
DRAIN_S = 30


def versions_in_active_plans(tenant_id: int | None = None) -> set[int]:
    """Every version an active (or just ended) plan may route or copy to: agents keep them."""
    recent = timezone.now() - timedelta(seconds=DRAIN_S)
    plans = RolloutPlan.objects.filter(Q(state__in=ACTIVE_STATES) | Q(updated_at__gte=recent))
    if tenant_id is not None:
        plans = plans.filter(model__tenant_id=tenant_id)
    ids: set[int] = set()
    for plan in plans.prefetch_related("arms"):
        ids.update((plan.baseline_id, plan.candidate_id))
        ids.update(arm.version_id for arm in plan.arms.all())
    return ids
