"""The traffic gate: the one judge of every change that can alter which version answers a
governed alias (one the rollout policy protects, ``production`` by default).

A change is judged on the routing it would produce, not on what kind of change it is, so a new
way of moving traffic cannot slip past a check written for an older one:

- the routing is each version's share of the alias's answers, computed as the gateways split
  them (``routing.shares_of``: an A/B plan's weights are relative, a split of zeros goes to its
  first arm), plus the model's fallback version, which answers whatever the primary fails or
  times out on, so it counts with its worst case: all of the alias's answers;
- its *exposure* is the share that could come from versions not approved for the alias: every
  version the alias has pointed at (each was promoted under approval, or was its very first
  version) and the candidates of its approved promotion requests;
- a change is applied when its exposure is within the limit (the policy's
  ``max_weight_without_approval``, and a plan's own ``max_weight``), or when no unapproved
  version gains share by it (lowering a weight, a kill, a rollback never wait for anyone).
  Otherwise the caller (``rollouts.approvals``) turns it into an approval request and applies
  nothing.

A fallback version is not a share a person tunes: it must already be approved for every
governed alias of its model (its last-known-good is), else the change is refused outright.
Moving a governed alias is a promotion whatever the target (``approvals.move_alias``).

Callers: ``actions.start_plan``, ``approvals`` (start, weights, arms, the guardrails' steps),
``actions`` kill and rollback, ``rollback.rollback_alias`` and ``update_model_settings`` below
(the fallback ladder). An approver's decision applies what was approved without asking again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from platform_site.errors import Forbidden
from registry import services as registry
from registry.models import AliasChange, Model, ModelVersion
from tenants.audit import Actor

from .models import (
    ACTIVE_STATES,
    ApprovalRequest,
    PlanMode,
    RequestKind,
    RequestState,
    RolloutPlan,
)
from .policy import is_protected, policy_for
from .routing import shares_of
from .strategies import STRATEGIES, Arm

APPROVED_STATES = (RequestState.APPROVED, RequestState.APPLIED)


@dataclass(frozen=True)
class Routing:
    """Who answers an alias: each version's percent of its answers, and the fallback version
    that answers when the primary fails (None: no fallback)."""

    shares: Mapping[int, float]
    fallback: int | None = None


@dataclass(frozen=True)
class Verdict:
    """The gate's judgement of one change on one alias."""

    alias: str
    governed: bool
    exposure: float  # percent of answers that could come from unapproved versions, after
    before: float  # ... and before the change
    limit: float
    gains: Mapping[int, float] = field(default_factory=dict)  # unapproved version id → gain

    @property
    def allowed(self) -> bool:
        return not self.governed or self.exposure <= self.limit or not self.gains

    def explain(self) -> str:
        return (
            f"{self.alias}: {self.exposure:g} % of its answers could come from versions not "
            f"approved for it (now {self.before:g} %); the rollout policy allows {self.limit:g} % "
            "without approval"
        )


def approved_versions(model: Model, alias: str) -> set[int]:
    """Versions approved to answer ``alias``: those it points or pointed at, and the targets of
    its approved promotion requests."""
    ids: set[int] = set(
        model.aliases.filter(name=alias).values_list("version_id", flat=True).distinct()
    )
    for to_id, from_id in AliasChange.objects.filter(model=model, alias=alias).values_list(
        "to_version_id", "from_version_id"
    ):
        ids.add(to_id)
        if from_id is not None:
            ids.add(from_id)
    ids.update(
        ApprovalRequest.objects.filter(
            model=model, alias=alias, kind=RequestKind.PROMOTION, state__in=APPROVED_STATES
        ).values_list("to_version_id", flat=True)
    )
    return ids


def canary_arms(plan: RolloutPlan, weight: float) -> list[Arm]:
    return start_arms(PlanMode.CANARY, plan.baseline_id, plan.candidate_id, weight, [])


def routing_now(model: Model, alias: str) -> Routing:
    """What answers ``alias`` now: its active plan's split, else the version it points at."""
    plan = active_plan(model, alias)
    if plan is not None:
        shares = shares_of(STRATEGIES[plan.mode].arms(plan))
    else:
        current = model.aliases.filter(name=alias).values_list("version_id", flat=True).first()
        shares = {current: 100.0} if current is not None else {}
    return Routing(shares, model.fallback_version_id)


def active_plan(model: Model, alias: str) -> RolloutPlan | None:
    return (
        RolloutPlan.objects.filter(model=model, alias=alias, state__in=ACTIVE_STATES)
        .prefetch_related("arms")
        .first()
    )


def exposure(routing: Routing, approved: set[int]) -> tuple[float, dict[int, float]]:
    """The percent of answers that could come from unapproved versions, and each one's share
    (a fallback outside ``approved`` counts with its worst case: every answer)."""
    unapproved = {v: s for v, s in routing.shares.items() if v not in approved and s > 0}
    if routing.fallback is not None and routing.fallback not in approved:
        unapproved[routing.fallback] = 100.0
    return min(100.0, sum(unapproved.values())), unapproved


def judge(model: Model, alias: str, proposed: Routing, *, cap: float | None = None) -> Verdict:
    """Judge the change of ``alias``'s routing to ``proposed`` (see the module's docstring).
    ``cap``: a lower limit of the change's own (a plan's ``max_weight``)."""
    policy = policy_for(model)
    # An alias that points nowhere yet answers nobody: its first version needs no approval.
    governed = is_protected(policy, alias) and model.aliases.filter(name=alias).exists()
    limit = policy.max_weight_without_approval
    if cap is not None:
        limit = min(limit, cap)
    approved = approved_versions(model, alias) if governed else set()
    after, shares_after = exposure(proposed, approved)
    before, shares_before = exposure(routing_now(model, alias), approved)
    gains = {
        v: share - shares_before.get(v, 0.0)
        for v, share in shares_after.items()
        if share > shares_before.get(v, 0.0) + 1e-9
    }
    return Verdict(alias, governed, after, before, limit, gains)


def judge_arms(model: Model, alias: str, arms: Iterable[Arm], cap: float | None) -> Verdict:
    """Judge routing ``alias`` to ``arms`` (a plan's), the model's fallback staying."""
    proposed = Routing(shares_of(list(arms)), model.fallback_version_id)
    return judge(model, alias, proposed, cap=cap)


def judge_plan(plan: RolloutPlan, arms: Iterable[Arm]) -> Verdict:
    """Judge giving an active plan ``arms`` (a canary's two, or an A/B plan's)."""
    return judge_arms(plan.model, plan.alias, arms, plan.max_weight)


def start_arms(
    mode: str, baseline_id: int, candidate_id: int, weight: float, arms: Iterable[Arm]
) -> list[Arm]:
    """The arms a new plan routes to (a shadow plan's copies answer nobody)."""
    if mode == PlanMode.CANARY:
        return [
            Arm("baseline", baseline_id, 100.0 - weight),
            Arm("candidate", candidate_id, weight),
        ]
    if mode == PlanMode.AB:
        return list(arms)
    return [Arm("baseline", baseline_id, 100.0)]


class AboveLimit(Forbidden):
    """A change the gate did not clear, applied without an approval."""

    def __init__(self, verdict: Verdict, what: str) -> None:
        super().__init__(
            f"traffic gate: {what} is refused. {verdict.explain()}: ask for it (a person's "
            "change above the limit becomes an approval request)"
        )
        self.verdict = verdict


def governed_aliases(model: Model) -> list[str]:
    """The model's aliases the rollout policy protects."""
    policy = policy_for(model)
    names = model.aliases.values_list("name", flat=True)
    return [n for n in names if is_protected(policy, n)]


# The fallback ladder ---------------------------------------------------------------------------


def check_fallback(model: Model, version: ModelVersion | None) -> None:
    """A fallback answers for every alias of its model when the primary fails, so its worst
    case is all of an alias's answers: it must already be approved for each governed alias
    (403 otherwise, saying which and what to do), whatever the policy's limit."""
    if version is None:
        return
    for alias in governed_aliases(model):
        if version.pk not in approved_versions(model, alias):
            raise Forbidden(
                f"traffic gate: v{version.version} is not approved for {alias!r}, and a fallback "
                f"answers up to all of {alias!r}'s requests when the primary fails. Choose a "
                f"version {alias!r} served before (its last-known-good) or promote "
                f"v{version.version} first"
            )


def update_model_settings(model: Model, changes: dict[str, Any], actor: Actor) -> Model:
    """A model's settings as a person changes them: the fallback ladder (``fallback_version``
    and its timeouts, ``default_answer``) through the gate, the rest as ``registry`` has it."""
    if changes.get("fallback_version") is not None:
        number = changes["fallback_version"]
        version = model.versions.filter(version=number).first()
        if version is not None:  # an unknown number is registry's 400 to give
            check_fallback(model, version)
    elif "fallback_version" not in changes and model.fallback_version_id is not None:
        if any(f in changes for f in registry.LADDER_FIELDS):
            # Timeouts and the default answer change how often the fallback answers: a
            # fallback set before the gate existed is judged again before they change.
            check_fallback(model, model.fallback_version)
    return registry.update_model_settings(model, changes, actor, judged=True)
