"""A rollout plan's arms and each arm's traffic numbers (``monitoring.traffic``): what the
guardrails, approval evidence, the API and the web UI's live charts compare.

Samples are counted per version, so an arm's numbers are its version's numbers.
"""

from __future__ import annotations

from datetime import datetime

from monitoring.traffic import arm_stats

from .models import RolloutPlan
from .strategies import STRATEGIES


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
