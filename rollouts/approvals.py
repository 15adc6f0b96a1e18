"""Approvals: changes that need a second person, decided under row locks with the evidence
frozen at the decision. What needs one is the rollout policy's to say (``rollouts.policy``).

- Moving a protected alias (the policy's ``protected_aliases``, default ``production``) that
  already points somewhere is a promotion request; so is a plan reaching its last step
  healthy. A plan's promotion may be approved at any time: the guardrails promote it once its
  last step is healthy past its bake time.
- A canary weight above what the policy allows without approval (or the plan's lower
  ``max_weight``) is a weight request, whoever asks: a person starting a plan or setting a
  weight, or the guardrails about to advance to such a step. A/B arm weights changed after
  the start are an arms request.

A request needs the policy's N distinct approvers (``ApprovalVote`` rows), none of them its
requester, compared by user id: a key's requests are its creator's, and a key with no creator
cannot ask. Decisions are a person's: never made with an API key. One rejection ends a request.
Every transition locks
the plan, then the alias, then the request (one order everywhere, so no deadlocks), so two
approvals racing each other or a rollback end in exactly one transition; the loser gets
``Conflict`` (409).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from monitoring import drift
from monitoring.quality import quality_by_version
from monitoring.traffic import arm_stats
from platform_site.errors import Conflict, Forbidden
from registry.models import Alias, Model, ModelVersion
from registry.services import set_alias
from tenants.audit import Actor, audit
from tenants.models import Role

from . import actions, gate
from .arms import metrics_diff, plan_arm_metrics
from .models import (
    ACTIVE_STATES,
    ApprovalRequest,
    ApprovalVote,
    PlanMode,
    PlanState,
    RequestKind,
    RequestState,
    RolloutPlan,
)
from .policy import check_freeze, freeze_reason, is_protected, policy_for
from .shadow import shadow_summary
from .strategies import Arm

GUARDRAILS = Actor(None, "guardrails")
# Without a plan, a promotion's evidence is each version's live traffic over this window.
DIRECT_WINDOW = timedelta(hours=1)


def needs_approval(model: Model, alias: str) -> bool:
    """Moving a protected alias needs approval, except its very first pointer (nothing to
    protect yet, and how a new model gets its first version into service)."""
    return is_protected(policy_for(model), alias) and model.aliases.filter(name=alias).exists()


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
) -> tuple[RolloutPlan, ApprovalRequest | None]:
    """A plan as a person starts it. A start the traffic gate does not clear starts held and
    asks for the rest: a canary at the limit, with the weight asked for as a weight request;
    an A/B plan with the arms of unapproved versions at 0 %, with the weights asked for as an
    arms request. So an unreviewed version never answers more than the policy allows. Returns
    the plan and that request (or None)."""
    current = model.aliases.filter(name=alias).values_list("version_id", flat=True).first()
    asked = [Arm(n, v.pk, w) for n, v, w in arms or []]
    routed = gate.start_arms(mode, current or 0, candidate.pk, weight, asked)
    verdict = gate.judge_arms(model, alias, routed, options.get("max_weight"))
    held = current is not None and not verdict.allowed
    start_weight, start_arms = weight, arms
    if held:
        check_requester(actor)  # before anything starts: a key with no owner cannot ask
        if mode == PlanMode.CANARY:
            start_weight = min(weight, verdict.limit)
        start_arms = [(n, v, 0.0 if v.pk in verdict.gains else w) for n, v, w in arms or []]
    plan = actions.start_plan(
        model,
        mode,
        candidate,
        guardrails,
        actor,
        alias=alias,
        weight=start_weight,
        arms=start_arms or None,
        **options,
    )
    if not held:
        return plan, None
    why = f"asked at the start; {verdict.explain()}"
    if mode == PlanMode.AB:
        weights = {n: float(w) for n, _, w in arms or []}
        req = _open_request(model, alias, RequestKind.ARMS, actor, why, plan, None, arms=weights)
    else:
        req = _open_request(model, alias, RequestKind.WEIGHT, actor, why, plan, weight)
    return plan, req


def advance_or_ask(plan: RolloutPlan, step: float, reason: str) -> tuple[str, str]:
    """The guardrails found the current step healthy past its bake time: advance to ``step``
    if the policy allows it (or an approver already approved the plan's promotion, which
    covers every weight up to 100 %), else open a weight request (once) and hold. Held during
    a release freeze. Returns the verdict (action, reason)."""
    frozen = freeze_reason(plan.model)
    if frozen is not None:
        RolloutPlan.objects.filter(pk=plan.pk).update(status_note=frozen[:300])
        return "hold", frozen
    # An approved promotion makes the candidate approved for the alias: the gate then clears
    # every step up to 100 %.
    verdict = gate.judge_plan(plan, gate.canary_arms(plan, step))
    if verdict.allowed:
        actions.set_weight(plan, step, GUARDRAILS, reason)
        return "advance", reason
    req = plan.requests.filter(kind=RequestKind.WEIGHT, state=RequestState.PENDING).first()
    if req is None:
        asked = f"{reason}: {verdict.explain()}"
        req = _open_request(
            plan.model, plan.alias, RequestKind.WEIGHT, GUARDRAILS, asked, plan, step
        )
    note = (
        f"healthy at {plan.weight:g} %: waiting for approval to go to {req.weight:g} % "
        f"(request #{req.pk})"
    )
    RolloutPlan.objects.filter(pk=plan.pk).update(status_note=note)
    return "hold", note


def move_alias(
    model: Model, alias: str, version: ModelVersion, actor: Actor, comment: str = ""
) -> Alias | ApprovalRequest:
    """An alias move as a person asks for it: direct, or a promotion request when protected."""
    if needs_approval(model, alias):
        return request_promotion(model, version, actor, alias=alias, comment=comment)
    return set_alias(model, alias, version, actor, comment)


def change_weight(
    plan: RolloutPlan, weight: float, actor: Actor, reason: str = ""
) -> RolloutPlan | ApprovalRequest:
    """A canary weight as a person sets it: direct within the policy's and the plan's bounds,
    else a request. Raising it is refused during a release freeze; lowering never is."""
    if plan.mode != PlanMode.CANARY:
        raise ValidationError({"weight": "only canary plans have a single weight"})
    if weight > plan.weight:
        check_freeze(plan.model, "raising a canary's weight")
    if not gate.judge_plan(plan, gate.canary_arms(plan, weight)).allowed:
        return _open_request(
            plan.model, plan.alias, RequestKind.WEIGHT, actor, reason, plan, weight
        )
    return actions.set_weight(plan, weight, actor, reason)


def change_arms(
    plan: RolloutPlan, weights: dict[str, float], actor: Actor, reason: str = ""
) -> RolloutPlan | ApprovalRequest:
    """A/B arm weights as a person sets them: applied when the traffic gate clears the split
    they make (the arms of unapproved versions, summed, within the policy's limit, or none of
    them gaining), else an arms request that an approver decides."""
    if plan.mode != PlanMode.AB:
        raise ValidationError({"arms": "only A/B plans have arms"})
    arms = list(plan.arms.all())
    actions.check_arm_weights({a.name for a in arms}, weights)
    check_freeze(plan.model, "changing A/B arm weights")
    routed = [Arm(a.name, a.version_id, float(weights[a.name])) for a in arms]
    if not gate.judge_plan(plan, routed).allowed:
        return _open_request(
            plan.model, plan.alias, RequestKind.ARMS, actor, reason, plan, None, arms=weights
        )
    return actions.set_arm_weights(plan, weights, actor, reason)


def request_promotion(
    model: Model,
    version: ModelVersion | None,
    actor: Actor,
    *,
    alias: str = "production",
    comment: str = "",
    plan: RolloutPlan | None = None,
) -> ApprovalRequest:
    """Ask to point ``alias`` at ``version`` (or at ``plan``'s candidate)."""
    check_freeze(model, "promoting")
    if plan is None:
        active = model.plans.filter(alias=alias, state__in=ACTIVE_STATES).first()
        if active is not None:
            raise Conflict(
                f"{alias!r} has an active rollout plan (#{active.pk}): "
                "request the promotion through the plan"
            )
    return _open_request(model, alias, RequestKind.PROMOTION, actor, comment, plan, None, version)


def _open_request(
    model: Model,
    alias: str,
    kind: str,
    actor: Actor,
    comment: str,
    plan: RolloutPlan | None,
    weight: float | None,
    version: ModelVersion | None = None,
    arms: dict[str, float] | None = None,
) -> ApprovalRequest:
    check_requester(actor)
    if plan is not None:
        if not plan.is_active:
            raise Conflict(f"the plan is {plan.state}")
        version = plan.candidate
    current = model.aliases.filter(name=alias).values_list("version_id", flat=True).first()
    if version is None or version.model_id != model.pk:
        raise ValidationError({"version": "must be a version of this model"})
    if plan is None and current == version.pk:
        raise ValidationError({"version": f"{alias!r} already points at v{version.version}"})
    req = ApprovalRequest(
        tenant_id=model.tenant_id,
        model=model,
        alias=alias,
        kind=kind,
        plan=plan,
        from_version_id=current,
        to_version=version,
        weight=weight,
        arm_weights=arms,
        approvals_needed=policy_for(model).approvals_needed,
        requested_by_id=actor.user_id,
        requested_label=actor.label,
        comment=comment,
    )
    try:
        with transaction.atomic():
            req.save()
            audit(
                model.tenant_id,
                actor,
                "approval.request",
                str(req),
                after=req.snapshot(),
                reason=comment,
            )
    except IntegrityError:
        raise Conflict(f"{model.name}@{alias} already has an open {kind} request") from None
    return req


def check_requester(actor: Actor) -> None:
    """A request needs someone to hold to the four-eyes rule: a person, a key with the person
    who created it (its user id), or the platform itself (the guardrails). A key without an
    owner could be any approver's: its requests are refused."""
    if actor.via_key is not None and actor.user_id is None:
        raise Forbidden(
            "this key has no owner: a request needs a person behind it (use a key created by "
            "a member, or sign in)"
        )


def approve(req: ApprovalRequest, actor: Actor, comment: str = "") -> ApprovalRequest:
    return _decide(req, actor, comment, approved=True)


def reject(req: ApprovalRequest, actor: Actor, comment: str = "") -> ApprovalRequest:
    return _decide(req, actor, comment, approved=False)


def _decide(req: ApprovalRequest, actor: Actor, comment: str, approved: bool) -> ApprovalRequest:
    if actor.via_key is not None:
        raise Forbidden("decide as a person in the web UI or with a session, not with an API key")
    if actor.role != Role.APPROVER or actor.user_id is None:
        raise Forbidden("only a member with the approver role can decide a request")
    if actor.user_id == req.requested_by_id:
        raise Forbidden("you cannot decide your own request: another approver must")
    with transaction.atomic():
        plan = None
        if req.plan_id is not None:
            plan = RolloutPlan.objects.select_for_update().get(pk=req.plan_id)
        alias = Alias.objects.select_for_update().filter(model_id=req.model_id, name=req.alias)
        current = alias.values_list("version_id", flat=True).first()
        locked = ApprovalRequest.objects.select_for_update().get(pk=req.pk)
        if locked.state != RequestState.PENDING:
            raise Conflict(f"request #{locked.pk} is already {locked.state}")
        if locked.votes.filter(user_id=actor.user_id).exists():
            raise Conflict(f"you already voted on request #{locked.pk}: another approver must")
        before = locked.snapshot()
        if approved:
            _check_still_holds(locked, plan, current)
        ApprovalVote.objects.create(
            request=locked,
            user_id=actor.user_id,
            label=actor.label,
            approved=approved,
            comment=comment,
        )
        yeses = locked.votes.filter(approved=True).count()
        if approved and yeses < locked.approvals_needed:
            # Not yet N of M: recorded and audited, the request stays pending.
            progress = {"approvals": yeses, "approvals_needed": locked.approvals_needed}
            audit(
                locked.tenant_id,
                actor,
                "approval.vote",
                str(locked),
                before,
                locked.snapshot() | progress,
                comment,
            )
            return locked
        locked.evidence = evidence_now(locked)  # frozen with the decision
        locked.decided_by_id = actor.user_id
        locked.decided_label = actor.label
        locked.decision_comment = comment
        locked.decided_at = timezone.now()
        if approved:
            locked.state = _carry_out(locked, plan, actor, comment)
        else:
            locked.state = RequestState.REJECTED
        locked.save()
        action = "approval.approve" if approved else "approval.reject"
        audit(locked.tenant_id, actor, action, str(locked), before, locked.snapshot(), comment)
    return locked


def _check_still_holds(req: ApprovalRequest, plan: RolloutPlan | None, current: int | None) -> None:
    """What was asked is still what would happen: else approving it would approve something
    nobody looked at."""
    if plan is not None:
        if not plan.is_active:
            raise Conflict(f"the plan is {plan.state}: the request no longer holds")
        if plan.candidate_id != req.to_version_id:
            raise Conflict("the plan's candidate changed: the request no longer holds")
    elif current != req.from_version_id:
        raise Conflict(f"{req.alias!r} moved since the request: it no longer holds")


def _carry_out(req: ApprovalRequest, plan: RolloutPlan | None, actor: Actor, comment: str) -> str:
    reason = f"approved request #{req.pk}" + (f": {comment}" if comment else "")
    if req.kind == RequestKind.ARMS:
        assert plan is not None and req.arm_weights is not None  # change_arms() opens these
        check_freeze(req.model, "changing A/B arm weights")
        actions.set_arm_weights(plan, req.arm_weights, actor, reason, approved=req)
        return RequestState.APPLIED
    if req.kind == RequestKind.WEIGHT:
        # change_weight() opens weight requests only on a plan, with the weight asked for.
        assert plan is not None and req.weight is not None
        if req.weight > plan.weight:
            check_freeze(req.model, "raising a canary's weight")
        actions.set_weight(plan, req.weight, actor, reason, approved=req)
        return RequestState.APPLIED
    if plan is None:
        check_freeze(req.model, "promoting")
        set_alias(req.model, req.alias, req.to_version, actor, reason)
        return RequestState.APPLIED
    # A plan's promotion is the guardrails' to carry out: once its last step is healthy past
    # its bake time (at once if it already is: the next evaluation is seconds away).
    return RequestState.APPROVED


def promote_when_approved(
    plan: RolloutPlan, reason: str, ready: str = "healthy at the last step"
) -> tuple[bool, str]:
    """The guardrails found the plan ready to promote (``ready`` says why, on the plan's note):
    promote if approved, else ask (once). Returns (promoted, what happened)."""
    with transaction.atomic():
        locked = RolloutPlan.objects.select_for_update().get(pk=plan.pk)
        if locked.state != PlanState.RUNNING:
            return False, f"the plan is {locked.state}"
        req = (
            ApprovalRequest.objects.select_for_update()
            .filter(plan=locked, kind=RequestKind.PROMOTION, state__in=["pending", "approved"])
            .first()
        )
        frozen = freeze_reason(locked.model)
        if frozen is not None:
            RolloutPlan.objects.filter(pk=locked.pk).update(status_note=frozen[:300])
            return False, frozen
        if req is not None and req.state == RequestState.APPROVED:
            if req.to_version_id != locked.candidate_id:
                raise Conflict("the plan's candidate changed: the approval no longer holds")
            actions.promote(locked, GUARDRAILS, f"{reason}; approved request #{req.pk}")
            req.state = RequestState.APPLIED
            req.save(update_fields=["state"])
            return True, f"promoted: approved request #{req.pk}"
        if req is None:
            # One open promotion request per alias: one a person opened outside the plan (a
            # move of the alias) is decided first, and the plan asks at its next look.
            other = (
                ApprovalRequest.objects.filter(
                    model=locked.model,
                    alias=locked.alias,
                    kind=RequestKind.PROMOTION,
                    state__in=["pending", "approved"],
                )
                .exclude(plan=locked)
                .first()
            )
            if other is not None:
                note = f"{ready}: waiting until request #{other.pk} on {locked.alias} is decided"
                RolloutPlan.objects.filter(pk=locked.pk).update(status_note=note[:300])
                return False, note
            req = request_promotion(
                locked.model, None, GUARDRAILS, alias=locked.alias, comment=reason, plan=locked
            )
        note = f"{ready}: waiting for approval (request #{req.pk})"
        RolloutPlan.objects.filter(pk=locked.pk).update(status_note=note)
        return False, note


def online_quality_evidence(req: ApprovalRequest, since: datetime) -> dict[str, dict[str, Any]]:
    """Both versions' online quality from ground-truth feedback since ``since``."""
    pairs = [("baseline", req.from_version_id), ("candidate", req.to_version_id)]
    ids = [vid for _, vid in pairs if vid is not None]
    measured = quality_by_version(ids, since)
    return {name: measured.get(vid, {}) for name, vid in pairs if vid is not None}


def evidence_now(req: ApprovalRequest) -> dict[str, Any]:
    """Per-arm metrics and their diff, the shadow agreement, offline metrics and the
    candidate's latest drift report (None when it has none)."""
    offline = {
        "baseline": req.from_version.offline_metrics if req.from_version else None,
        "candidate": req.to_version.offline_metrics,
    }
    plan = req.plan
    if plan is None:
        # The latest plan that tried this version on this alias says how it did live.
        plan = (
            req.model.plans.filter(alias=req.alias, candidate=req.to_version)
            .order_by("-created_at")
            .first()
        )
    if plan is not None:
        arms = plan_arm_metrics(plan)
        since = plan.created_at
    else:
        since = timezone.now() - DIRECT_WINDOW
        pairs = [("baseline", req.from_version), ("candidate", req.to_version)]
        arms = [
            {"arm": name, "version": v.version, "weight": None} | arm_stats(v.pk, since).as_dict()
            for name, v in pairs
            if v is not None
        ]
    shadow = shadow_summary(plan) if plan is not None and plan.mode == PlanMode.SHADOW else None
    return {
        "at": timezone.now().isoformat(),
        "since": since.isoformat(),
        "plan": plan.pk if plan is not None else None,
        "arms": arms,
        "diff": metrics_diff(arms),
        "shadow": shadow,
        "offline_metrics": offline,
        "drift": drift.evidence(req.to_version_id),
        "quality": online_quality_evidence(req, since),
    }


def evidence_of(req: ApprovalRequest) -> dict[str, Any]:
    """Frozen evidence once decided; live while pending."""
    return req.evidence if req.evidence is not None else evidence_now(req)


def pending_count(tenant_id: int) -> int:
    return ApprovalRequest.objects.filter(tenant_id=tenant_id, state=RequestState.PENDING).count()
