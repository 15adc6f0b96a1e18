"""Guardrails: compare a canary's candidate with its baseline over the current step, then
advance, hold, promote or roll back.

The comparison stays honest at low traffic: nothing moves until both arms have ``min_samples``
requests ("waiting for data"), and the error check is a one-sided two-proportion z-test of
"candidate error rate exceeds baseline's by more than the allowed increase", so noise on a few
requests neither rolls back a good candidate nor promotes a bad one. The candidate's latest drift
report since the plan started (``monitoring.drift``) is a breach too when its worst PSI is past
the plan's ``max_drift_psi`` (absent: the model's ``drift_threshold``; null: not checked).
With ``max_quality_drop`` set, online quality from ground-truth feedback (``monitoring.quality``)
is compared too, once both arms have ``min_samples`` labelled rows: a classifier's accuracy may
fall at most that much below the baseline's (absolute), a regressor's MAE rise at most that
share above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from monitoring.drift import describe, latest_report
from monitoring.models import DriftReport
from monitoring.quality import quality_by_version
from monitoring.traffic import LATENCY_BOUNDS_MS, ArmStats, arm_stats

from . import actions
from .approvals import GUARDRAILS, promote_when_approved
from .models import PlanMode, PlanState, RolloutPlan

Z_CRITICAL = 2.326  # one-sided, 1 % false-alarm rate


@dataclass(frozen=True)
class Verdict:
    action: str  # "wait", "hold", "advance", "promote" or "rollback"
    reason: str


def error_increase_z(base: ArmStats, cand: ArmStats, allowed: float) -> float:
    """z of H1: p_candidate - p_baseline > allowed (pooled two-proportion test)."""
    pooled = (base.errors + cand.errors) / (base.requests + cand.requests)
    spread = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / base.requests + 1 / cand.requests))
    return (cand.error_rate - base.error_rate - allowed) / spread


def judge(
    guardrails: dict,
    base: ArmStats,
    cand: ArmStats,
    baked: bool,
    last_step: bool,
    drift: DriftReport | None = None,
    drift_limit: float | None = None,
    quality: tuple[dict, dict] | None = None,
) -> Verdict:
    """The decision for one evaluation, from the two arms' numbers, the candidate's latest
    drift report and, when the plan asks, both arms' online quality (baseline, candidate)."""
    need = int(guardrails["min_samples"])
    if base.requests < need or cand.requests < need:
        return Verdict(
            "wait",
            f"waiting for data: baseline {base.requests}/{need}, "
            f"candidate {cand.requests}/{need} requests",
        )
    if drift is not None and drift_limit is not None and drift.max_psi > drift_limit:
        return Verdict("rollback", f"drift: {describe(drift, drift_limit)}")
    worse = quality_breach(guardrails, quality, need) if quality is not None else None
    if worse is not None:
        return Verdict("rollback", worse)
    z = error_increase_z(base, cand, guardrails["max_error_rate_increase"])
    if z > Z_CRITICAL:
        return Verdict(
            "rollback",
            f"error rate {cand.error_rate:.2%} vs baseline {base.error_rate:.2%} (z={z:.1f})",
        )
    ratio = cand.p99_ms / max(base.p99_ms, LATENCY_BOUNDS_MS[0])
    if ratio > guardrails["max_p99_ratio"]:
        return Verdict(
            "rollback", f"p99 {cand.p99_ms:g} ms is {ratio:.1f}x the baseline's {base.p99_ms:g} ms"
        )
    if not baked:
        return Verdict("hold", "healthy, baking")
    return Verdict("promote" if last_step else "advance", "healthy past its bake time")


def quality_breach(guardrails: dict, quality: tuple[dict, dict], need: int) -> str | None:
    """Why the candidate's online quality is worse than allowed, or None (also while either
    arm has fewer than ``need`` labelled rows: labels arrive late)."""
    allowed = guardrails.get("max_quality_drop")
    base, cand = quality
    if allowed is None or min(base.get("labelled_rows", 0), cand.get("labelled_rows", 0)) < need:
        return None
    if base.get("accuracy") is not None and cand.get("accuracy") is not None:
        if base["accuracy"] - cand["accuracy"] > allowed:
            return (
                f"online accuracy {cand['accuracy']:.3f} vs baseline {base['accuracy']:.3f} "
                f"(allowed drop {allowed:g})"
            )
    if base.get("mae") is not None and cand.get("mae") is not None:
        if cand["mae"] > base["mae"] * (1 + allowed):
            return (
                f"online MAE {cand['mae']:.4g} vs baseline {base['mae']:.4g} "
                f"(allowed rise {allowed:.0%})"
            )
    return None


def drift_limit_of(plan: RolloutPlan) -> float | None:
    """The plan's ``max_drift_psi``; absent means the model's threshold, None no check."""
    return plan.guardrails.get("max_drift_psi", plan.model.drift_threshold)


def next_weight(plan: RolloutPlan) -> float | None:
    """The first step above the current weight, or None at the last step."""
    above = [float(s) for s in plan.steps if float(s) > plan.weight]
    return min(above) if above else None


def evaluate(plan: RolloutPlan, now: datetime | None = None) -> Verdict:
    """Judge a running canary on its current step and carry the verdict out."""
    now = now or timezone.now()
    if plan.mode != PlanMode.CANARY or plan.state != PlanState.RUNNING:
        return Verdict("hold", "only running canary plans are evaluated")
    # At a 100 % step the baseline gets no traffic any more: judge the candidate's step against
    # what the baseline served during the whole plan.
    base_since = plan.step_started_at if plan.weight < 100 else plan.created_at
    base = arm_stats(plan.baseline_id, base_since)
    cand = arm_stats(plan.candidate_id, plan.step_started_at)
    baked = (now - plan.step_started_at).total_seconds() >= plan.bake_seconds
    limit = drift_limit_of(plan)
    drift = latest_report(plan.candidate_id, plan.created_at) if limit is not None else None
    step = next_weight(plan)
    last_step = step is None
    quality = None
    if plan.guardrails.get("max_quality_drop") is not None:
        measured = quality_by_version([plan.baseline_id, plan.candidate_id], plan.created_at)
        quality = (measured.get(plan.baseline_id, {}), measured.get(plan.candidate_id, {}))
    verdict = judge(plan.guardrails, base, cand, baked, last_step, drift, limit, quality)
    if verdict.action == "rollback":
        actions.rollback(plan, GUARDRAILS, verdict.reason)
    elif verdict.action == "advance":
        assert step is not None  # judge() advances only below the last step
        actions.set_weight(plan, step, GUARDRAILS, verdict.reason)
    elif verdict.action == "promote":
        # Promotion moves a protected alias: it needs an approver's yes (asked for once).
        promoted, note = promote_when_approved(plan, verdict.reason)
        verdict = Verdict("promote" if promoted else "hold", note)
    else:
        RolloutPlan.objects.filter(pk=plan.pk).update(status_note=verdict.reason)
    return verdict
