"""Sticky, reproducible arm assignment: a hash of (plan, routing key) picks a bucket."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
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


def live_arms(arms: Sequence[Arm]) -> tuple[tuple[Arm, ...], tuple[int, ...]]:
    """The arms that get traffic and the upper bucket bound of each: weights are relative (an
    A/B plan's need not sum to 100), and a split of zeros sends everything to its first arm."""
    live = tuple(a for a in arms if a.weight > 0)
    if not live:
        return tuple(arms[:1]), (BUCKETS,) if arms else ()
    total = sum(a.weight for a in live)
    bounds, running = [], 0.0
    for arm in live:
        running += arm.weight
        bounds.append(round(running / total * BUCKETS))
    return live, tuple(bounds)


def shares_of(arms: Sequence[Arm]) -> dict[int, float]:
    """Each version's percent of the answers, exactly as the buckets of ``split_of`` give it:
    the traffic gate (``rollouts.gate``) judges what the gateways will do, not the weights."""
    live, bounds = live_arms(arms)
    shares: dict[int, float] = {}
    lower = 0
    for arm, bound in zip(live, bounds, strict=True):
        shares[arm.version_id] = shares.get(arm.version_id, 0.0) + (bound - lower) * 100 / BUCKETS
        lower = bound
    return shares


def split_of(plan: RolloutPlan) -> Split:
    strategy = STRATEGIES[plan.mode]
    arms, bounds = live_arms(strategy.arms(plan))
    return Split(plan.pk, arms, bounds, plan.routing_header.lower(), strategy.shadow(plan))


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
