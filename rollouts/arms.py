"""A rollout plan's arms and each arm's traffic numbers (``monitoring.traffic``): what the
guardrails, approval evidence, the API and the web UI's live charts compare; and the two
changes the guardrails make to an A/B plan's arms (drop one, declare the winner).

A canary's arms are distinct versions and are read per version (so requests that asked for the
version explicitly count too); an A/B plan's arms are read per (plan, arm), because two arms may
serve one version. A shadow arm's numbers come from its ``ShadowSample`` rows: shadow copies are
never counted as the version's traffic.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from monitoring.traffic import arm_stats
from platform_site.errors import Conflict
from tenants.audit import Actor, audit

from . import gate
from .models import PlanArm, PlanMode, RolloutPlan
from .strategies import STRATEGIES, Arm


def plan_arms(plan: RolloutPlan) -> list[tuple[str, int, float]]:
    """(arm name, version id, weight) of every arm, plus the shadow candidate at weight 0."""
    strategy = STRATEGIES[plan.mode]
    arms = [(a.name, a.version_id, a.weight) for a in strategy.arms(plan)]
    shadow = strategy.shadow(plan)
    if shadow is not None:
        arms.append(("shadow", shadow[0], 0.0))
    return arms


def shadow_stats(plan: RolloutPlan, since: datetime) -> dict[str, Any]:
    """The shadow copies' outcome as an arm's numbers (no latency is kept for them)."""
    totals = plan.shadow_samples.filter(window_end__gte=since).aggregate(
        answered=Sum("answered"), failed=Sum("failed")
    )
    failed = totals["failed"] or 0
    requests = (totals["answered"] or 0) + failed
    return {
        "requests": requests,
        "errors": failed,
        "error_rate": round(failed / requests, 6) if requests else 0.0,
        "p50_ms": None,
        "p95_ms": None,
        "p99_ms": None,
    }


def arm_numbers(plan: RolloutPlan, name: str, version_id: int, since: datetime) -> dict[str, Any]:
    if name == "shadow":
        return shadow_stats(plan, since)
    if plan.mode == PlanMode.AB:
        return arm_stats(None, since, plan_arm=(plan.pk, name)).as_dict()
    return arm_stats(version_id, since).as_dict()


def plan_arm_metrics(plan: RolloutPlan, since: datetime | None = None) -> list[dict[str, Any]]:
    """Each arm's numbers since ``since`` (default: since the plan started)."""
    since = since or plan.created_at
    versions = dict(plan.model.versions.values_list("pk", "version"))
    return [
        {"arm": name, "version": versions.get(vid), "weight": weight}
        | arm_numbers(plan, name, vid, since)
        for name, vid, weight in plan_arms(plan)
    ]


def metrics_diff(arms: list[dict[str, Any]], need: int = 1) -> dict[str, Any] | None:
    """Candidate minus baseline for the numbers an approver compares (canary and shadow).
    With fewer than ``need`` requests on either side there is nothing to compare: then
    ``{"not_enough_data": True, "n": {"baseline": …, "candidate": …}, "need": need}``, never a
    diff against zeros (a candidate with no requests is not "5 ms faster"). A diff carries
    each side's ``n``."""
    by_name = {a["arm"]: a for a in arms}
    base = by_name.get("baseline")
    cand = by_name.get("candidate") or by_name.get("shadow")
    if base is None or cand is None:
        return None
    if min(base["requests"], cand["requests"]) < max(need, 1):
        n = {"baseline": base["requests"], "candidate": cand["requests"]}
        return {"not_enough_data": True, "n": n, "need": max(need, 1)}
    diff: dict[str, Any] = {}
    for key in ("error_rate", "p50_ms", "p95_ms", "p99_ms"):
        if base[key] is not None and cand[key] is not None:
            diff[key] = round(cand[key] - base[key], 6)
    diff["n"] = {"baseline": base["requests"], "candidate": cand["requests"]}
    return diff


# The guardrails' changes to an A/B plan ----------------------------------------------------------


def _weights(plan: RolloutPlan) -> dict[str, Any]:
    return {"arms": {a.name: a.weight for a in plan.arms.all()}, "ab_result": plan.ab_result}


def drop_arm(plan: RolloutPlan, arm: PlanArm, actor: Actor, reason: str) -> None:
    """An arm that breached a guardrail gets no more traffic (weight 0; the gateways follow
    within a second). Its weight goes to the baseline's arm, so every other arm keeps its share
    of the answers (weights are relative: dropped alone, the rest would grow); the traffic gate
    judges the result like any change (``gate.AboveLimit`` when no baseline arm can take it and
    unapproved arms would grow). Audited as ``plan.arm_drop``."""
    with transaction.atomic():
        locked = RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        if not locked.is_active:
            raise Conflict(f"the plan is {locked.state}")
        before = _weights(locked)
        arms = {a.pk: a for a in locked.arms.select_for_update()}
        row = arms[arm.pk]
        keeper = next(
            (a for a in arms.values() if a.version_id == locked.baseline_id and a.pk != row.pk),
            None,
        )
        changed = [row]
        if keeper is not None:
            keeper.weight += row.weight
            changed.append(keeper)
        row.weight = 0.0
        verdict = gate.judge_plan(
            locked, [Arm(a.name, a.version_id, a.weight) for a in arms.values()]
        )
        if not verdict.allowed:
            raise gate.AboveLimit(verdict, f"dropping arm {row.name!r}")
        for changed_arm in changed:  # saves, so the gateways' route caches follow
            changed_arm.save(update_fields=["weight"])
        locked.status_note = reason
        locked.save(update_fields=["status_note", "updated_at"])
        audit(
            locked.model.tenant_id,
            actor,
            "plan.arm_drop",
            str(locked),
            before,
            _weights(locked),
            reason,
        )


def declare_ab_result(
    plan: RolloutPlan, actor: Actor, winner: str | None, metric: str, reason: str
) -> None:
    """Record an A/B plan's outcome once (``winner`` None: no difference at the sample cap).
    Audited as ``plan.ab_winner``; traffic does not move (promotion stays a person's act)."""
    with transaction.atomic():
        locked = RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        if not locked.is_active or locked.ab_result is not None:
            return  # ended, or decided by another worker's look
        before = _weights(locked)
        locked.ab_result = {
            "winner": winner,
            "metric": metric,
            "reason": reason,
            "at": timezone.now().isoformat(),
        }
        locked.status_note = reason
        locked.save(update_fields=["ab_result", "status_note", "updated_at"])
        audit(
            locked.model.tenant_id,
            actor,
            "plan.ab_winner",
            str(locked),
            before,
            _weights(locked),
            reason,
        )
