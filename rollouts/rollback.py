"""Break-glass rollback of an alias: one click, one person, flagged for review.

An engineer (or an API key) may move an alias back to a version it pointed at before without
an approval, because undoing a bad release must not wait for a second person. The move is
``registry.services.set_alias`` with ``break_glass=True``: an ``alias.rollback`` audit event and
an ``AliasChange`` flagged for review, in the same transaction as killing the alias's active
rollout plan (if any), so gateways see the plan gone and the alias moved in one generation. An
alert says who did it; an approver other than that person marks it reviewed, which resolves the
alert. Only a version the alias pointed at before can be the target: break-glass never ships a
version nobody reviewed for this alias.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from monitoring.alerts import raise_alert, resolve_alert
from monitoring.models import AlertKind
from platform_site.errors import Conflict, Forbidden, NotFound
from registry.access import alias_for, version_for
from registry.models import Alias, AliasChange, Model, ModelVersion
from registry.services import alias_history, set_alias
from tenants.audit import Actor, audit
from tenants.models import Role

from . import gate
from .actions import kill
from .models import ACTIVE_STATES, RolloutPlan

DEFAULT_REASON = "break-glass rollback"


def alert_key(change: AliasChange) -> str:
    return f"alias-rollback:{change.pk}"


def rollback_alias(
    model: Model, alias: str, actor: Actor, to_version: int | None = None, reason: str = ""
) -> AliasChange:
    """Move ``alias`` back to ``to_version`` (default: the version it pointed at before its
    last move), killing its active plan first. The caller checked the actor may write.

    Refused with 409 when the alias already points at the target, and when no version is
    named and the alias's last move was itself a rollback (rolling back twice does not
    flip-flop between two versions: name the older version to go further back); with 400 when
    the target is a version the alias never pointed at."""
    reason = reason.strip() or DEFAULT_REASON
    with transaction.atomic():
        # Row lock: a rollback racing a promotion or another rollback ends in one state.
        found = alias_for(model, alias)
        current = Alias.objects.select_for_update().get(pk=found.pk)
        target = _target(model, alias, current, to_version)
        # The target is a version the alias pointed at, approved for it: the gate clears it.
        verdict = gate.judge(
            model, alias, gate.Routing({target.pk: 100.0}, model.fallback_version_id)
        )
        if not verdict.allowed:
            raise gate.AboveLimit(verdict, f"rolling back to v{target.version}")
        plan = (
            RolloutPlan.objects.filter(model=model, alias=alias, state__in=ACTIVE_STATES)
            .select_related("model", "baseline", "candidate")
            .first()
        )
        if plan is not None:
            kill(plan, actor, f"{reason} (alias {alias} rolled back to v{target.version})")
        set_alias(model, alias, target, actor, reason, break_glass=True)
        change = alias_history(model, alias).first()
        assert change is not None and change.to_version_id == target.pk
        raise_alert(
            model.tenant_id,
            AlertKind.ROLLBACK,
            alert_key(change),
            f"{model.name}@{alias}: break-glass rollback by {actor.label} to v{target.version}, "
            "needs review",
            reason,
            model_id=model.pk,
            severity="warning",
            details={
                "alias": alias,
                "from": change.from_version.version if change.from_version else None,
                "to": target.version,
                "change": change.pk,
                "plan_killed": plan.pk if plan is not None else None,
            },
        )
    return change


def _target(model: Model, alias: str, current: Alias, to_version: int | None) -> ModelVersion:
    history = alias_history(model, alias)
    if to_version is None:
        last = history.first()
        if last is None or last.from_version is None:
            raise Conflict(f"{model.name}@{alias} never pointed at another version")
        if last.break_glass:
            raise Conflict(
                f"{model.name}@{alias} was already rolled back to v{last.to_version.version} "
                f"by {last.actor_label}; name to_version to go further back"
            )
        target = last.from_version
    else:
        try:
            target = version_for(model, to_version)
        except NotFound as exc:
            raise ValidationError({"to_version": str(exc)}) from None
    if target.pk == current.version_id:
        raise Conflict(f"{model.name}@{alias} already points at v{target.version}")
    if target.pk not in pointed_at(model, alias):
        raise ValidationError(
            {
                "to_version": f"{model.name}@{alias} never pointed at v{target.version}: a "
                "break-glass rollback only returns to a version the alias served before"
            }
        )
    return target


def pointed_at(model: Model, alias: str) -> set[int]:
    """The ids of every version the alias ever pointed at: the only break-glass targets."""
    history = alias_history(model, alias)
    pointed = set(history.values_list("to_version_id", flat=True))
    earlier = history.filter(from_version__isnull=False).values_list("from_version_id", flat=True)
    return pointed | {pk for pk in earlier if pk is not None}


def rollback_targets(model: Model, alias: Alias) -> list[ModelVersion]:
    """The versions this alias may be rolled back to now, newest first (the page's choice)."""
    ids = pointed_at(model, alias.name) - {alias.version_id}
    return list(model.versions.filter(pk__in=ids).order_by("-version"))


def review_rollback(change: AliasChange, actor: Actor, comment: str = "") -> AliasChange:
    """An approver marks a break-glass rollback reviewed (never the person who took it, and
    once), audited in the same transaction; its alert is resolved."""
    if actor.role != Role.APPROVER:
        raise Forbidden("only a member with the approver role can review a rollback")
    with transaction.atomic():
        locked = AliasChange.objects.select_for_update().select_related("model").get(pk=change.pk)
        if not locked.break_glass:
            raise Conflict("only a break-glass rollback needs a review")
        if locked.reviewed_at is not None:
            raise Conflict(f"already reviewed by {locked.reviewed_by_label}")
        if actor.user_id is None or actor.user_id == locked.actor_id:
            raise Forbidden("you cannot review your own rollback: another approver must")
        locked.reviewed_by_id = actor.user_id
        locked.reviewed_by_label = actor.label
        locked.reviewed_at = timezone.now()
        locked.review_comment = comment
        locked.save(
            update_fields=["reviewed_by", "reviewed_by_label", "reviewed_at", "review_comment"]
        )
        target = f"{locked.model}@{locked.alias}"
        before = {"change": locked.pk, "reviewed": False}
        after = {"change": locked.pk, "reviewed": True}
        audit(locked.model.tenant_id, actor, "alias.review", target, before, after, comment)
        resolve_alert(locked.model.tenant_id, alert_key(locked))
    return locked


def change_for(model: Model, alias: str, change_id: int) -> AliasChange:
    """One change of this alias's history (the model was looked up through its tenant)."""
    found = alias_history(model, alias_for(model, alias).name).filter(pk=change_id).first()
    if found is None:
        raise NotFound(f"{model.name}@{alias} has no history entry {change_id}")
    return found
