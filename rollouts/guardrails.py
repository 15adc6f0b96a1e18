"""Guardrails: judge a running plan's arms on the numbers since its current step started, then
advance, hold, promote, roll back (canary), or drop an arm and declare a winner (A/B).

The beat task looks every few seconds at data that keeps growing, so every test here is one
whose false-alarm rate holds over repeated looks or is tiny per look (``rollouts.stats``):

- error rate: an always-valid sequential test (mSPRT) of "the candidate's error rate exceeds
  the baseline's by more than ``max_error_rate_increase``", rejected at ``alpha`` (default
  0.01, the plan's ``guardrails.alpha``), once both arms have ``min_samples`` requests;
- p99: distribution-free order-statistic bounds from the fine latency histograms; rolled back
  only when the candidate's lower bound is past ``max_p99_ratio`` times the baseline's upper
  bound (each bound at alpha/2); with too few requests to bound a p99, the highest quantile
  that can be bounded is judged instead, and named;
- early abort: before ``min_samples``, a candidate whose error rate is, at alpha 1e-6, at
  least ``early_abort_margin`` (default 0.2) above the baseline's upper bound is rolled back
  at once (a 100 %-failing candidate after a dozen requests);
- drift: the candidate's output scores against the baseline's over the plan's window, from the
  prediction log (same traffic: input drift that hits both arms does not count);
- online quality (``max_quality_drop``), once both arms have ``min_samples`` labelled rows.

A step still waiting for data past its bake time, at a rate that will not reach
``min_samples`` within ``stall_hours`` (default 24), raises a ``stalled`` alert once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils import timezone

from monitoring.alerts import raise_alert, resolve_alert
from monitoring.drift import ArmDrift, compare_arms
from monitoring.models import AlertKind
from monitoring.quality import quality_by_version
from monitoring.traffic import ArmStats, arm_stats

from . import actions
from .approvals import GUARDRAILS, advance_or_ask, promote_when_approved
from .arms import declare_ab_result, drop_arm
from .gate import AboveLimit
from .models import PlanArm, PlanMode, PlanState, RolloutPlan
from .stats import (
    error_excess,
    excess_p_values,
    proportion_lower,
    proportion_upper,
    quantile_bounds,
)

DEFAULT_ALPHA = 0.01
EARLY_ALPHA = 1e-6  # per look: 10,000 looks still leave a 1 % false-alarm rate (Bonferroni)
EARLY_MIN_REQUESTS = 10
DEFAULT_EARLY_MARGIN = 0.2
DEFAULT_STALL_HOURS = 24.0
AB_CAP_FACTOR = 10  # an A/B plan with no winner at this many x min_samples per arm: no difference


@dataclass(frozen=True)
class Verdict:
    action: str  # "wait", "hold", "advance", "promote", "rollback", "drop" or "decide"
    reason: str


def alpha_of(guardrails: dict[str, Any]) -> float:
    return float(guardrails.get("alpha") or DEFAULT_ALPHA)


def short(reason: str) -> str:
    """A reason as the plan's ``status_note`` (300 characters) holds it."""
    return reason if len(reason) <= 300 else reason[:297] + "..."


def pct(rate: float) -> str:
    return f"{rate * 100:.2f} %"


# The checks: each returns why the candidate breaches, or None ---------------------------------


def early_abort(guardrails: dict[str, Any], base: ArmStats, cand: ArmStats) -> str | None:
    """Egregious failure before ``min_samples``: the candidate's error rate's lower bound at a
    tiny alpha is past the baseline's upper bound plus a large margin."""
    if cand.requests < EARLY_MIN_REQUESTS:
        return None
    margin = float(guardrails.get("early_abort_margin") or DEFAULT_EARLY_MARGIN)
    low = proportion_lower(cand.errors, cand.requests, EARLY_ALPHA)
    high = proportion_upper(base.errors, base.requests, EARLY_ALPHA)
    if low <= high + margin:
        return None
    return (
        f"early abort: candidate failed {cand.errors} of {cand.requests} requests (at least "
        f"{pct(low)}) vs baseline {base.errors} of {base.requests} (at most {pct(high)}), "
        f"past the {margin:.0%} margin at alpha {EARLY_ALPHA:g}, before min_samples"
    )


def error_breach(guardrails: dict[str, Any], base: ArmStats, cand: ArmStats) -> str | None:
    allowed = float(guardrails["max_error_rate_increase"])
    test = error_excess(
        (base.errors, base.requests), (cand.errors, cand.requests), allowed, alpha_of(guardrails)
    )
    if not test.significant:
        return None
    return (
        f"error rate {pct(test.cand_rate)} vs baseline {pct(test.base_rate)} (allowed "
        f"+{allowed * 100:g} pt), sequential p={test.p_value:.2g} < alpha {test.alpha:g} over "
        f"{cand.requests}/{base.requests} requests"
    )


# The p99 first; with too few requests to bound a baseline's p99 from above (about 460 at
# alpha 0.01), the highest quantile that can be: a candidate 100x slower on its first dozens of
# requests is caught, and the reason names the quantile judged.
QUANTILES = (0.99, 0.95, 0.9, 0.75, 0.5)


def latency_breach(guardrails: dict[str, Any], base: ArmStats, cand: ArmStats) -> str | None:
    """The p99 past ``max_p99_ratio`` x the baseline's, beyond sampling error."""
    limit = float(guardrails["max_p99_ratio"])
    alpha = alpha_of(guardrails) / 2  # two bounds, one alpha
    for q in QUANTILES:
        base_q = quantile_bounds(base.fine, q, alpha)
        if not math.isinf(base_q.upper_ms):
            break
    else:
        return None
    cand_q = quantile_bounds(cand.fine, q, alpha)
    if cand_q.lower_ms <= limit * base_q.upper_ms:
        return None
    name = f"p{q * 100:g}"
    fewer = "" if q == QUANTILES[0] else f", too few requests ({base_q.samples}) to bound a p99"
    return (
        f"{name} at least {cand_q.lower_ms:.1f} ms vs the baseline's at most "
        f"{base_q.upper_ms:.1f} ms: at least {cand_q.lower_ms / base_q.upper_ms:.1f}x, "
        f"limit {limit:g}x (order-statistic bounds, alpha {alpha_of(guardrails):g}{fewer})"
    )


def quality_breach(
    guardrails: dict[str, Any], quality: tuple[dict[str, Any], dict[str, Any]], need: int
) -> str | None:
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


def drift_breach(drift: ArmDrift | None, limit: float | None) -> str | None:
    """The candidate's scores differ from the baseline's on the same traffic."""
    if drift is None or limit is None:
        return None
    psi = drift.score_psi
    if psi is None or psi <= limit:
        return None
    return f"drift: {drift.describe()}"


def first_breach(
    guardrails: dict[str, Any],
    base: ArmStats,
    cand: ArmStats,
    drift: ArmDrift | None = None,
    drift_limit: float | None = None,
    quality: tuple[dict[str, Any], dict[str, Any]] | None = None,
    base_need: int | None = None,
) -> str | None:
    """The first guardrail the candidate breaches: before ``min_samples`` only an egregious
    failure counts; from there every check. ``base_need``: the baseline's own sample size
    where it differs (see ``judge``)."""
    need = int(guardrails["min_samples"])
    if base.requests < (need if base_need is None else base_need) or cand.requests < need:
        return early_abort(guardrails, base, cand)
    # The request-level checks first: their reasons are the most direct ones to act on.
    for reason in (
        error_breach(guardrails, base, cand),
        latency_breach(guardrails, base, cand),
        quality_breach(guardrails, quality, need) if quality is not None else None,
        drift_breach(drift, drift_limit),
    ):
        if reason is not None:
            return reason
    return None


def judge(
    guardrails: dict[str, Any],
    base: ArmStats,
    cand: ArmStats,
    baked: bool,
    last_step: bool,
    drift: ArmDrift | None = None,
    drift_limit: float | None = None,
    quality: tuple[dict[str, Any], dict[str, Any]] | None = None,
    base_need: int | None = None,
) -> Verdict:
    """A canary's decision for one look, from the two arms' numbers, the candidate's drift
    against the baseline and, when the plan asks, both arms' online quality. ``base_need``:
    how many baseline requests the look needs when that is not ``min_samples`` (at a 100 %
    step the baseline gets no traffic, so what it served during the plan is all there is)."""
    breach = first_breach(guardrails, base, cand, drift, drift_limit, quality, base_need)
    if breach is not None:
        return Verdict("rollback", breach)
    need = int(guardrails["min_samples"])
    base_need = need if base_need is None else base_need
    if base.requests < base_need or cand.requests < need:
        return Verdict(
            "wait",
            f"waiting for data: baseline {base.requests}/{base_need}, "
            f"candidate {cand.requests}/{need} requests",
        )
    if not baked:
        return Verdict("hold", "healthy, baking")
    reason = "healthy past its bake time"
    if base_need < need:
        reason += (
            f" (against the {base.requests} requests the baseline served during the plan: "
            "at 100 % it gets none)"
        )
    return Verdict("promote" if last_step else "advance", reason)


# Stalls ----------------------------------------------------------------------------------------


def stall_reason(
    guardrails: dict[str, Any], counts: dict[str, int], elapsed_s: float, bake_s: float
) -> str | None:
    """Why a step waiting for data will not get it in time: past its bake time, the slowest
    arm's observed request rate will not reach ``min_samples`` within ``stall_hours``."""
    if elapsed_s < max(bake_s, 1.0):
        return None
    need = int(guardrails["min_samples"])
    bound_h = float(guardrails.get("stall_hours") or DEFAULT_STALL_HOURS)
    worst: tuple[float, str, int] | None = None
    for name, requests in counts.items():
        if requests >= need:
            continue
        rate = requests / elapsed_s
        hours = (need - requests) / rate / 3600 if rate > 0 else math.inf
        if worst is None or hours > worst[0]:
            worst = (hours, name, requests)
    if worst is None or worst[0] <= bound_h:
        return None
    hours, name, requests = worst
    eta = "never at its current rate" if math.isinf(hours) else f"in about {hours:.0f} h"
    return (
        f"stalled: {name} has {requests}/{need} requests after {elapsed_s / 3600:.1f} h; "
        f"it would reach min_samples {eta}, past the {bound_h:g} h bound"
    )


def stall_key(plan: RolloutPlan) -> str:
    return f"stalled:{plan.pk}"


def flag_stall(plan: RolloutPlan, reason: str | None) -> None:
    """Raise the plan's stall alert (once: repeats refresh the open one) or resolve it."""
    tenant_id = plan.model.tenant_id
    if reason is None:
        resolve_alert(tenant_id, stall_key(plan))
        return
    raise_alert(
        tenant_id,
        AlertKind.STALLED,
        stall_key(plan),
        f"{plan.model.name}: rollout #{plan.pk} cannot reach its sample size",
        reason,
        model_id=plan.model_id,
        details={"plan": plan.pk, "min_samples": plan.guardrails.get("min_samples")},
    )


# Canary ----------------------------------------------------------------------------------------


def drift_limit_of(plan: RolloutPlan) -> float | None:
    """The plan's ``max_drift_psi``; absent means the model's threshold, None no check."""
    return plan.guardrails.get("max_drift_psi", plan.model.drift_threshold)


def next_weight(plan: RolloutPlan) -> float | None:
    """The first step above the current weight, or None at the last step."""
    above = [float(s) for s in plan.steps if float(s) > plan.weight]
    return min(above) if above else None


def evaluate(plan: RolloutPlan, now: datetime | None = None) -> Verdict:
    """Judge a running plan once and carry the verdict out."""
    now = now or timezone.now()
    if plan.state != PlanState.RUNNING:
        return Verdict("hold", "only running plans are evaluated")
    if plan.mode == PlanMode.AB:
        return evaluate_ab(plan, now)
    if plan.mode != PlanMode.CANARY:
        return Verdict("hold", "only canary and A/B plans are evaluated")
    # At a 100 % step the baseline gets no traffic any more: judge the candidate's step against
    # what the baseline served during the whole plan.
    base_since = plan.step_started_at if plan.weight < 100 else plan.created_at
    base = arm_stats(plan.baseline_id, base_since)
    cand = arm_stats(plan.candidate_id, plan.step_started_at)
    elapsed = (now - plan.step_started_at).total_seconds()
    baked = elapsed >= plan.bake_seconds
    limit = drift_limit_of(plan)
    drift = (
        compare_arms(plan.baseline_id, plan.candidate_id, plan.created_at, now, limit)
        if limit is not None
        else None
    )
    step = next_weight(plan)
    last_step = step is None
    quality = None
    if plan.guardrails.get("max_quality_drop") is not None:
        measured = quality_by_version([plan.baseline_id, plan.candidate_id], plan.created_at)
        quality = (measured.get(plan.baseline_id, {}), measured.get(plan.candidate_id, {}))
    # At 100 % the baseline's count cannot grow: the step is judged against what it served
    # during the plan, however many that was, or the plan would wait for data forever.
    need = int(plan.guardrails["min_samples"])
    base_need = need if plan.weight < 100 else min(need, base.requests)
    verdict = judge(plan.guardrails, base, cand, baked, last_step, drift, limit, quality, base_need)
    if verdict.action == "wait":
        counts = {"candidate": cand.requests}
        if base_need == need:
            counts["baseline"] = base.requests
        stalled = stall_reason(plan.guardrails, counts, elapsed, plan.bake_seconds)
        flag_stall(plan, stalled)
        if stalled is not None:
            verdict = Verdict("wait", f"{verdict.reason}; {stalled}")
    verdict = Verdict(verdict.action, short(verdict.reason))
    if verdict.action == "rollback":
        actions.rollback(plan, GUARDRAILS, verdict.reason)
    elif verdict.action == "advance":
        assert step is not None  # judge() advances only below the last step
        verdict = Verdict(*advance_or_ask(plan, step, verdict.reason))  # within the policy
    elif verdict.action == "promote":
        # Promotion moves a protected alias: it needs an approver's yes (asked for once).
        promoted, note = promote_when_approved(plan, verdict.reason)
        verdict = Verdict("promote" if promoted else "hold", note)
    else:
        RolloutPlan.objects.filter(pk=plan.pk).update(status_note=verdict.reason)
    return verdict


# A/B -------------------------------------------------------------------------------------------


def reference_arm(plan: RolloutPlan, arms: list[PlanArm]) -> PlanArm:
    """The arm every other is compared with: the one serving the baseline version, else the
    first by name."""
    return next((a for a in arms if a.version_id == plan.baseline_id), arms[0])


def arm_failures(
    plan: RolloutPlan, arms: list[PlanArm], stats: dict[str, ArmStats], need: int
) -> tuple[str, dict[str, tuple[int, int]]]:
    """What an A/B plan's winner is judged on, per arm (failures, trials): wrong answers from
    ground-truth feedback when every arm has ``min_samples`` labelled rows and its own version
    (quality is kept per version), else failed requests."""
    versions = [a.version_id for a in arms]
    if len(set(versions)) == len(versions):
        measured = quality_by_version(versions, plan.step_started_at)
        labelled = {a.name: measured.get(a.version_id, {}) for a in arms}
        if all(
            q.get("accuracy") is not None and q.get("labelled_rows", 0) >= need
            for q in labelled.values()
        ):
            return "online accuracy", {
                name: (round((1 - q["accuracy"]) * q["labelled_rows"]), q["labelled_rows"])
                for name, q in labelled.items()
            }
    return "error rate", {a.name: (stats[a.name].errors, stats[a.name].requests) for a in arms}


def ab_winner(
    metric: str, failures: dict[str, tuple[int, int]], alpha: float
) -> tuple[str, str] | None:
    """(arm, reason) of the arm whose failure rate is significantly below every other arm's
    (sequential test, alpha split over the comparisons it must win), or None."""
    per_test = alpha / max(len(failures) - 1, 1)
    for name, (fails, trials) in failures.items():
        others = {o: c for o, c in failures.items() if o != name}
        ps = {o: float(excess_p_values(fails, trials, c[0], c[1], 0.0)) for o, c in others.items()}
        if ps and all(p < per_test for p in ps.values()):
            rate = 1 - fails / trials if metric == "online accuracy" else fails / trials
            shown = ", ".join(
                f"{o} {pct(1 - c[0] / c[1] if metric == 'online accuracy' else c[0] / c[1])} "
                f"(p={ps[o]:.2g})"
                for o, c in others.items()
            )
            return name, (
                f"winner: arm {name}, {metric} {pct(rate)} vs {shown}; sequential test, "
                f"alpha {alpha:g}"
            )
    return None


def evaluate_ab(plan: RolloutPlan, now: datetime) -> Verdict:
    """Judge an A/B plan: every arm against the reference arm on the guardrails (an arm that
    breaches one is dropped to weight 0, audited), then the winner on online quality (or the
    error rate) once significant, or "no difference" at the sample cap. The plan keeps running:
    a winning candidate is promoted once an approver approves it (promote_ab_winner)."""
    arms = list(plan.arms.all())
    if not arms:
        return Verdict("hold", "an A/B plan without arms")
    reference = reference_arm(plan, arms)
    stats = {
        a.name: arm_stats(None, plan.step_started_at, plan_arm=(plan.pk, a.name)) for a in arms
    }
    for arm in arms:
        if arm.pk == reference.pk or arm.weight <= 0:
            continue
        breach = first_breach(plan.guardrails, stats[reference.name], stats[arm.name])
        if breach is not None:
            reason = short(f"arm {arm.name} vs {reference.name}: {breach}")
            try:
                drop_arm(plan, arm, GUARDRAILS, reason)
            except AboveLimit:
                # No approved arm can take its traffic: end the plan, all of it to the baseline.
                reason = short(f"{reason}; no baseline arm to take its share: rolled back")
                actions.rollback(plan, GUARDRAILS, reason)
                return Verdict("rollback", reason)
            return Verdict("drop", reason)
    active = [a for a in arms if a.weight > 0]
    need = int(plan.guardrails["min_samples"])
    if plan.ab_result is not None:
        verdict = promote_ab_winner(plan, arms)
    elif any(stats[a.name].requests < need for a in active):
        shown = ", ".join(f"{a.name} {stats[a.name].requests}/{need}" for a in active)
        elapsed = (now - plan.step_started_at).total_seconds()
        counts = {a.name: stats[a.name].requests for a in active}
        stalled = stall_reason(plan.guardrails, counts, elapsed, plan.bake_seconds)
        flag_stall(plan, stalled)
        note = f"waiting for data: {shown} requests" + (f"; {stalled}" if stalled else "")
        verdict = Verdict("wait", note)
    elif len(active) < 2:
        verdict = Verdict("hold", f"only arm {active[0].name if active else '-'} is left")
    else:
        verdict = decide_ab(plan, active, stats, need)
    if verdict.action != "decide":
        RolloutPlan.objects.filter(pk=plan.pk).update(status_note=short(verdict.reason))
    return verdict


def promote_ab_winner(plan: RolloutPlan, arms: list[PlanArm]) -> Verdict:
    """A decided A/B plan whose winner is the candidate's arm goes the way a healthy canary at
    its last step does: the guardrails ask for the promotion once and carry it out when an
    approver has approved it (an approval given before the result counts too). Any other
    result (the baseline won, no difference) holds until a person ends the plan."""
    result = plan.ab_result or {}
    won = next((a for a in arms if a.name == result.get("winner")), None)
    if won is None or won.version_id != plan.candidate_id:
        return Verdict("hold", result.get("reason", "decided"))
    reason = f"A/B {result.get('reason', 'decided')}"
    promoted, note = promote_when_approved(plan, reason, ready=f"arm {won.name} won")
    return Verdict("promote" if promoted else "hold", note)


def decide_ab(
    plan: RolloutPlan, active: list[PlanArm], stats: dict[str, ArmStats], need: int
) -> Verdict:
    """Declare a winner (or no difference at the cap), or keep measuring."""
    metric, failures = arm_failures(plan, active, stats, need)
    alpha = alpha_of(plan.guardrails)
    found = ab_winner(metric, failures, alpha)
    cap = int(plan.guardrails.get("ab_max_samples") or AB_CAP_FACTOR * need)
    if found is not None:
        winner, reason = found
    elif all(trials >= cap for _, trials in failures.values()):
        winner, reason = (
            None,
            (
                f"no difference: no arm's {metric} is significantly better at the cap of {cap} "
                f"per arm (alpha {alpha:g})"
            ),
        )
    else:
        shown = ", ".join(f"{name} {f}/{n}" for name, (f, n) in failures.items())
        return Verdict("hold", f"measuring {metric}: {shown}; no significant difference yet")
    reason = short(reason)
    declare_ab_result(plan, GUARDRAILS, winner, metric, reason)
    return Verdict("decide", reason)
