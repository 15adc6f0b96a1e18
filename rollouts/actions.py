"""Rollout actions: validate, change state under a row lock, and write the audit event in the
same transaction. Views and tasks call these and nothing else."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from monitoring.alerts import raise_alert
from monitoring.models import AlertKind
from platform_site.errors import Conflict
from registry.models import Model, ModelVersion
from registry.services import set_alias
from tenants.audit import Actor, audit

from . import gate
from . import policy as rollout_policy
from .models import (
    OPEN_REQUEST_STATES,
    ApprovalRequest,
    PlanArm,
    PlanMode,
    PlanState,
    RequestState,
    RolloutPlan,
)
from .strategies import Arm

GUARDRAIL_KEYS = {"max_error_rate_increase", "max_p99_ratio", "min_samples"}
# Optional: the candidate's drift PSI past which it is rolled back; absent means the model's
# drift_threshold, null turns the drift check off.
OPTIONAL_GUARDRAIL_KEYS = {"max_drift_psi", "max_quality_drop"}
# Optional statistics settings (rollouts.guardrails): the tests' false-alarm rate, the early
# abort's margin, the stall alert's bound, an A/B plan's sample cap.
OPTIONAL_GUARDRAIL_KEYS |= {"alpha", "early_abort_margin", "stall_hours", "ab_max_samples"}


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def check_guardrails(guardrails: Any) -> dict[str, Any]:
    """A plan cannot start without guardrails: each threshold present and sensible."""
    keys = set(guardrails) if isinstance(guardrails, dict) else set()
    if keys - OPTIONAL_GUARDRAIL_KEYS != GUARDRAIL_KEYS:
        raise ValidationError(
            {
                "guardrails": f"a plan needs guardrails with exactly {sorted(GUARDRAIL_KEYS)} "
                f"(and optionally {sorted(OPTIONAL_GUARDRAIL_KEYS)})"
            }
        )
    for key in GUARDRAIL_KEYS:
        if not _positive(guardrails[key]):
            raise ValidationError({"guardrails": f"{key} must be a positive number"})
    for key in OPTIONAL_GUARDRAIL_KEYS:
        value = guardrails.get(key)
        if value is not None and not _positive(value):
            raise ValidationError({"guardrails": f"{key} must be a positive number or null"})
    if guardrails.get("alpha") is not None and not guardrails["alpha"] < 0.5:
        raise ValidationError({"guardrails": "alpha must be below 0.5 (e.g. 0.01)"})
    return guardrails


def start_plan(
    model: Model,
    mode: str,
    candidate: ModelVersion,
    guardrails: Any,
    actor: Actor,
    *,
    alias: str = "production",
    weight: float = 0.0,
    arms: list[tuple[str, ModelVersion, float]] | None = None,
    **options: Any,
) -> RolloutPlan:
    """Start a plan from the version the alias points at now (the baseline), within the
    rollout policy: its required guardrails, no candidate weight or A/B arm above what it
    allows without approval (``approvals.start_plan`` asks for more), the plan's own
    ``max_weight`` capped by it, and no start during a release freeze."""
    check_guardrails(guardrails)
    policy = rollout_policy.policy_for(model)
    rollout_policy.check_required_guardrails(policy, guardrails)
    limit = rollout_policy.weight_limit(policy, alias, mode)
    options["max_weight"] = min(options.get("max_weight", limit), limit)
    current = model.aliases.select_related("version").filter(name=alias).first()
    if current is None:
        raise ValidationError({"alias": f"model {model.name!r} has no {alias!r} alias to move"})
    if candidate.model_id != model.pk or candidate.pk == current.version_id:
        raise ValidationError({"candidate": "must be another version of this model"})
    if candidate.inputs != current.version.inputs:
        raise ValidationError({"candidate": "its input signature differs from the baseline's"})
    if mode == PlanMode.AB and not arms:
        raise ValidationError({"arms": "an A/B plan needs arms"})
    routed = gate.start_arms(
        mode, current.version_id, candidate.pk, weight, [Arm(n, v.pk, w) for n, v, w in arms or []]
    )
    verdict = gate.judge_arms(model, alias, routed, options["max_weight"])
    if not verdict.allowed:
        raise gate.AboveLimit(verdict, "starting this plan")
    rollout_policy.check_freeze(model, "starting a rollout")
    plan = RolloutPlan(
        model=model,
        alias=alias,
        mode=mode,
        baseline=current.version,
        candidate=candidate,
        weight=weight,
        weights_run=[ran(weight)] if mode == PlanMode.CANARY else [],
        guardrails=guardrails,
        created_by_id=actor.user_id,
        **options,
    )
    plan.full_clean(validate_constraints=False)
    try:
        with transaction.atomic():
            plan.save()
            for name, version, share in arms or []:
                PlanArm.objects.create(plan=plan, name=name, version=version, weight=share)
            audit(model.tenant_id, actor, "plan.start", str(plan), after=_state(plan))
    except IntegrityError:
        raise ValidationError({"alias": "this alias already has an active rollout plan"}) from None
    return plan


def set_arm_weights(
    plan: RolloutPlan,
    weights: dict[str, float],
    actor: Actor,
    reason: str = "",
    *,
    approved: ApprovalRequest | None = None,
) -> RolloutPlan:
    """Give an A/B plan's arms new weights (every arm named); takes effect within a second.
    Cleared by the traffic gate under the plan's lock, unless ``approved`` asked for it."""
    with transaction.atomic():
        locked = RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        if locked.mode != PlanMode.AB:
            raise ValidationError({"arms": "only A/B plans have arms"})
        if not locked.is_active:
            raise Conflict(f"the plan is {locked.state}")
        arms = {a.name: a for a in locked.arms.select_for_update()}
        check_arm_weights(set(arms), weights)
        if approved is None:
            routed = [Arm(n, a.version_id, float(weights[n])) for n, a in arms.items()]
            verdict = gate.judge_plan(locked, routed)
            if not verdict.allowed:
                raise gate.AboveLimit(verdict, "these arm weights")
        before = {**_state(locked), "arms": {n: a.weight for n, a in arms.items()}}
        for name, arm in arms.items():
            arm.weight = float(weights[name])
            arm.save(update_fields=["weight"])
        locked.step_started_at = timezone.now()
        locked.status_note = reason
        locked.save(update_fields=["step_started_at", "status_note", "updated_at"])
        after = {**_state(locked), "arms": {n: float(w) for n, w in weights.items()}}
        audit(locked.model.tenant_id, actor, "plan.arms", str(locked), before, after, reason)
    return locked


def check_arm_weights(names: set[str], weights: Any) -> None:
    if not isinstance(weights, dict) or set(weights) != names:
        raise ValidationError({"arms": f"give a weight for each arm: {sorted(names)}"})
    for name, share in weights.items():
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 100:
            raise ValidationError({"arms": f"arm {name!r}: a percent from 0 to 100"})


def set_weight(
    plan: RolloutPlan,
    weight: float,
    actor: Actor,
    reason: str = "",
    *,
    approved: ApprovalRequest | None = None,
) -> RolloutPlan:
    """Move a canary's candidate share; takes effect at the gateways within a second.
    Cleared by the traffic gate under the plan's lock, unless ``approved`` asked for it."""
    if not 0 <= weight <= 100:
        raise ValidationError({"weight": "must be between 0 and 100"})
    with transaction.atomic():
        # Row lock: a weight change racing a rollback ends in one consistent state.
        locked = RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        if locked.mode != PlanMode.CANARY:
            raise ValidationError({"weight": "only canary plans have a single weight"})
        if not locked.is_active:
            raise Conflict(f"the plan is {locked.state}")
        if approved is None:
            verdict = gate.judge_plan(locked, gate.canary_arms(locked, weight))
            if not verdict.allowed:
                raise gate.AboveLimit(verdict, f"a {weight:g} % canary")
        before = _state(locked)
        locked.weight = weight
        locked.step_started_at = timezone.now()  # the new step bakes and is judged from here
        locked.status_note = reason
        locked.weights_run = [*locked.weights_run, ran(weight)]
        fields = ["weight", "step_started_at", "status_note", "weights_run", "updated_at"]
        locked.save(update_fields=fields)
        audit(
            locked.model.tenant_id,
            actor,
            "plan.weight",
            str(locked),
            before,
            _state(locked),
            reason,
        )
    return locked


def ran(weight: float) -> dict[str, Any]:
    """One entry of ``RolloutPlan.weights_run``."""
    return {"weight": float(weight), "at": timezone.now().isoformat()}


def kill(plan: RolloutPlan, actor: Actor, reason: str = "") -> RolloutPlan:
    """The kill switch: all traffic back to the baseline (last known good) at once."""
    return _end(plan, actor, reason, "plan.kill")


def rollback(plan: RolloutPlan, actor: Actor, reason: str) -> RolloutPlan:
    """A guardrail breach: the same as the kill switch, recorded as a rollback, and alerted."""
    ended = _end(plan, actor, reason, "plan.rollback")
    raise_alert(
        ended.model.tenant_id,
        AlertKind.ROLLBACK,
        f"rollback:{ended.pk}",
        f"{ended.model.name}: rollout #{ended.pk} rolled back to v{ended.baseline.version}",
        reason,
        model_id=ended.model_id,
        severity="critical",
        details={"plan": ended.pk, "candidate": ended.candidate.version},
    )
    return ended


def _end(plan: RolloutPlan, actor: Actor, reason: str, action: str) -> RolloutPlan:
    with transaction.atomic():
        # Row lock: a rollback racing a weight change or another rollback ends in one state.
        locked = RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        if not locked.is_active:
            raise Conflict(f"the plan is already {locked.state}")
        # All traffic back to the baseline, the version the alias points at: the gate clears
        # it (no unapproved version gains), so a kill never waits for anyone.
        back = [Arm("baseline", locked.baseline_id, 100.0)]
        verdict = gate.judge_plan(locked, back)
        if not verdict.allowed:
            raise gate.AboveLimit(verdict, "returning to the baseline")
        before = _state(locked)
        locked.state = PlanState.ROLLED_BACK
        locked.weight = 0.0
        locked.status_note = reason
        locked.save(update_fields=["state", "weight", "status_note", "updated_at"])
        audit(locked.model.tenant_id, actor, action, str(locked), before, _state(locked), reason)
        cancel_open_requests(locked, actor, f"the plan was stopped: {reason}")
    return locked


def pause(plan: RolloutPlan, actor: Actor, reason: str = "") -> RolloutPlan:
    """Hold the split where it is: the guardrails neither advance nor promote a paused plan."""
    return _switch(plan, actor, reason or "paused", PlanState.RUNNING, PlanState.PAUSED)


def resume(plan: RolloutPlan, actor: Actor, reason: str = "") -> RolloutPlan:
    """Back under the guardrails; the current step is judged afresh from now."""
    return _switch(plan, actor, reason or "resumed", PlanState.PAUSED, PlanState.RUNNING)


def _switch(plan: RolloutPlan, actor: Actor, reason: str, source: str, target: str) -> RolloutPlan:
    with transaction.atomic():
        locked = RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        if locked.state != source:
            raise Conflict(f"the plan is {locked.state}, not {source}")
        before = _state(locked)
        locked.state = target
        locked.step_started_at = timezone.now()
        locked.status_note = reason
        locked.save(update_fields=["state", "step_started_at", "status_note", "updated_at"])
        action = "plan.pause" if target == PlanState.PAUSED else "plan.resume"
        audit(locked.model.tenant_id, actor, action, str(locked), before, _state(locked), reason)
    return locked


def promote(plan: RolloutPlan, actor: Actor, reason: str) -> RolloutPlan:
    """Point the alias at the candidate and close the plan. Only ``approvals`` calls this, once
    an approver other than the requester has approved the promotion."""
    with transaction.atomic():
        locked = RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        if locked.state != PlanState.RUNNING:
            raise Conflict(f"the plan is {locked.state}")
        before = _state(locked)
        set_alias(locked.model, locked.alias, locked.candidate, actor, reason)
        locked.state = PlanState.PROMOTED
        locked.status_note = reason
        locked.save(update_fields=["state", "status_note", "updated_at"])
        audit(
            locked.model.tenant_id,
            actor,
            "plan.promote",
            str(locked),
            before,
            _state(locked),
            reason,
        )
    return locked


def cancel_open_requests(plan: RolloutPlan, actor: Actor, reason: str) -> None:
    """The plan ended: what was asked of it no longer holds. Called inside the plan's lock."""
    for req in ApprovalRequest.objects.select_for_update().filter(
        plan=plan, state__in=OPEN_REQUEST_STATES
    ):
        before = req.snapshot()
        req.state = RequestState.CANCELLED
        req.decision_comment = reason
        req.save(update_fields=["state", "decision_comment"])
        audit(req.tenant_id, actor, "approval.cancel", str(req), before, req.snapshot(), reason)


def _state(plan: RolloutPlan) -> dict[str, Any]:
    return {
        "state": plan.state,
        "weight": plan.weight,
        "mode": plan.mode,
        "baseline": plan.baseline.version,
        "candidate": plan.candidate.version,
    }
