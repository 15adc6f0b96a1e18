"""Rollout policy: what a tenant (or one of its models) lets traffic do without an approval, and
the release freeze when a model's error budget is spent.

A policy is set by an approver (``set_policy``), never by the person starting a plan: the
largest candidate weight on a protected alias without approval, guardrails every plan must set
beyond the three always required, how many distinct approvers a request needs (N of M) and
which aliases are protected. ``policy_for(model)`` is the model's own policy, else the tenant's
default, else the built-in defaults (10 %, no extra guardrails, one approver, ``production``).

The release freeze: while one of a model's SLO error budgets (``monitoring.slo``) is spent,
starting a plan, advancing a step and promoting are refused (409), unless an approver set a
freeze override with a reason and an expiry. Rollbacks and kills are never frozen.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from monitoring.slo import error_budget_spent
from platform_site.errors import Conflict, Forbidden
from registry.models import Alias, Model
from tenants.audit import Actor, audit
from tenants.models import Membership, Role

from .models import FreezeOverride, PlanMode, RolloutPolicy

POLICY_FIELDS = (
    "max_weight_without_approval",
    "required_guardrails",
    "approvals_needed",
    "protected_aliases",
)
# Guardrails a policy may require on top of the three every plan sets (rollouts.actions).
REQUIRABLE_GUARDRAILS = ("max_drift_psi", "max_quality_drop")
MAX_OVERRIDE = timedelta(days=7)


def policy_for(model: Model) -> RolloutPolicy:
    """The model's policy, else its tenant's default, else the defaults (unsaved)."""
    found = (
        RolloutPolicy.objects.filter(Q(model=model) | Q(tenant_id=model.tenant_id, model=None))
        .order_by(F("model_id").asc(nulls_last=True))  # the model's own first
        .first()
    )
    return found or RolloutPolicy(tenant_id=model.tenant_id)


def tenant_policy(tenant_id: int) -> RolloutPolicy:
    """The tenant's default policy, else the defaults (unsaved)."""
    found = RolloutPolicy.objects.filter(tenant_id=tenant_id, model=None).first()
    return found or RolloutPolicy(tenant_id=tenant_id)


def is_protected(policy: RolloutPolicy, alias: str) -> bool:
    return alias in policy.protected_aliases


def weight_limit(policy: RolloutPolicy, alias: str, mode: str) -> float:
    """The largest candidate weight a plan may carry without approval: the policy's on a
    protected alias; shadow plans move no user traffic and other aliases need no approval."""
    if mode == PlanMode.SHADOW or not is_protected(policy, alias):
        return 100.0
    return policy.max_weight_without_approval


def check_required_guardrails(policy: RolloutPolicy, guardrails: dict[str, Any]) -> None:
    missing = [k for k in policy.required_guardrails if guardrails.get(k) is None]
    if missing:
        raise ValidationError(
            {"guardrails": f"the rollout policy requires {', '.join(missing)} to be set"}
        )


def _clean(tenant_id: int, values: dict[str, Any]) -> dict[str, Any]:
    """Hostile input gets a 400 naming the field, whatever the caller sent."""
    clean: dict[str, Any] = {}
    unknown = set(values) - set(POLICY_FIELDS)
    if unknown:
        raise ValidationError({sorted(unknown)[0]: "not a rollout policy field"})
    if "max_weight_without_approval" in values:
        limit = values["max_weight_without_approval"]
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 <= limit <= 100:
            raise ValidationError({"max_weight_without_approval": "a percent from 0 to 100"})
        clean["max_weight_without_approval"] = float(limit)
    if "required_guardrails" in values:
        wanted = values["required_guardrails"]
        if not isinstance(wanted, list) or any(k not in REQUIRABLE_GUARDRAILS for k in wanted):
            raise ValidationError(
                {"required_guardrails": f"a list of {', '.join(REQUIRABLE_GUARDRAILS)}"}
            )
        clean["required_guardrails"] = sorted(set(wanted))
    if "approvals_needed" in values:
        n = values["approvals_needed"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10:
            raise ValidationError({"approvals_needed": "a whole number from 1 to 10"})
        approvers = Membership.objects.filter(tenant_id=tenant_id, role=Role.APPROVER).count()
        # More than the tenant's approvers and no request could ever pass. (A request made by
        # an approver needs N others: with N equal to M, approvers' own requests stall.)
        if n > max(approvers, 1):
            raise ValidationError(
                {"approvals_needed": f"the tenant has {approvers} approver(s): at most that many"}
            )
        clean["approvals_needed"] = n
    if "protected_aliases" in values:
        names = values["protected_aliases"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValidationError({"protected_aliases": "a list of alias names"})
        field = Alias._meta.get_field("name")
        for name in names:
            try:
                field.clean(name, None)
            except ValidationError:
                raise ValidationError({"protected_aliases": f"{name!r} is no alias name"}) from None
        clean["protected_aliases"] = sorted(set(names))
    return clean


def _require_approver(actor: Actor, what: str) -> None:
    if actor.via_key is not None or actor.user_id is None or actor.role != Role.APPROVER:
        raise Forbidden(f"only an approver, signed in as a person, can {what}")


def set_policy(
    tenant_id: int, model: Model | None, values: dict[str, Any], actor: Actor, reason: str = ""
) -> RolloutPolicy:
    """Set the tenant's default policy (``model`` None) or a model's; fields not given keep
    their current value (a new model policy starts from the tenant's). Audited."""
    _require_approver(actor, "set a rollout policy")
    clean = _clean(tenant_id, values)
    with transaction.atomic():
        policy = (
            RolloutPolicy.objects.select_for_update()
            .filter(tenant_id=tenant_id, model=model)
            .first()
        )
        if policy is None:
            start = tenant_policy(tenant_id) if model is not None else None
            policy = RolloutPolicy(tenant_id=tenant_id, model=model)
            if start is not None:
                for field in POLICY_FIELDS:
                    setattr(policy, field, getattr(start, field))
            before: dict[str, Any] = {}
        else:
            before = policy.snapshot()
        for field, value in clean.items():
            setattr(policy, field, value)
        policy.updated_by_id = actor.user_id
        try:
            policy.save()
        except IntegrityError:  # two approvers creating the same policy at once
            raise Conflict("the policy changed meanwhile: try again") from None
        target = f"{model}" if model is not None else "tenant default"
        audit(
            tenant_id,
            actor,
            "policy.set",
            f"rollout policy: {target}",
            before,
            policy.snapshot(),
            reason,
        )
    return policy


# Release freeze -----------------------------------------------------------------------------


def active_override(model: Model, now: datetime | None = None) -> FreezeOverride | None:
    now = now or timezone.now()
    return FreezeOverride.objects.filter(model=model, expires_at__gt=now).first()


def freeze_reason(model: Model, now: datetime | None = None) -> str | None:
    """ "release freeze: …" while an error budget of the model is spent and no override holds;
    None otherwise."""
    spent = error_budget_spent(model, now)
    if not spent or active_override(model, now) is not None:
        return None
    return "release freeze: " + "; ".join(spent)


def check_freeze(model: Model, what: str) -> None:
    """Refuse ``what`` (starting a plan, advancing, promoting) during a release freeze."""
    reason = freeze_reason(model)
    if reason is not None:
        raise Conflict(
            f"{reason}. {what} of {model.name} is refused until the budget recovers or an "
            "approver sets a freeze override"
        )


def freeze_status(model: Model) -> dict[str, Any]:
    now = timezone.now()
    override = active_override(model, now)
    spent = error_budget_spent(model, now)
    return {
        "model": model.name,
        "budget_spent": spent,
        "frozen": bool(spent) and override is None,
        "override": None
        if override is None
        else {
            "reason": override.reason,
            "expires_at": override.expires_at.isoformat(),
            "by": override.created_label,
        },
    }


def override_freeze(model: Model, actor: Actor, reason: str, hours: float) -> FreezeOverride:
    """An approver lets releases of ``model`` go on for ``hours`` despite a spent budget."""
    _require_approver(actor, "override a release freeze")
    if not reason.strip():
        raise ValidationError({"reason": "say why releases may go on with the budget spent"})
    if not 0 < hours <= MAX_OVERRIDE.total_seconds() / 3600:
        raise ValidationError({"hours": f"from 0 to {MAX_OVERRIDE.total_seconds() / 3600:g}"})
    with transaction.atomic():
        override = FreezeOverride.objects.create(
            model=model,
            reason=reason,
            expires_at=timezone.now() + timedelta(hours=hours),
            created_by_id=actor.user_id,
            created_label=actor.label,
        )
        audit(
            model.tenant_id,
            actor,
            "freeze.override",
            f"{model}",
            after={
                "expires_at": override.expires_at.isoformat(),
                "budget_spent": error_budget_spent(model),
            },
            reason=reason,
        )
    return override
