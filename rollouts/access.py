"""Tenant-scoped lookups of rollout plans and approval requests: every lookup by an id that a
caller sent goes through here, so another tenant's plan or request is the same 404 as one that
does not exist."""

from __future__ import annotations

from django.db.models import QuerySet

from platform_site.errors import NotFound

from .models import ApprovalRequest, RolloutPlan


def plans_of(tenant_id: int) -> QuerySet[RolloutPlan]:
    return (
        RolloutPlan.objects.filter(model__tenant_id=tenant_id)
        .select_related("model", "baseline", "candidate", "created_by")
        .prefetch_related("arms")
    )


def plan_for(tenant_id: int, plan_id: int) -> RolloutPlan:
    found = plans_of(tenant_id).filter(pk=plan_id).first()
    if found is None:
        raise NotFound(f"no rollout plan {plan_id}")
    return found


def approvals_of(tenant_id: int) -> QuerySet[ApprovalRequest]:
    return (
        ApprovalRequest.objects.filter(tenant_id=tenant_id)
        .select_related("model", "plan", "from_version", "to_version")
        .prefetch_related("votes")
    )


def approval_for(tenant_id: int, request_id: int) -> ApprovalRequest:
    found = approvals_of(tenant_id).filter(pk=request_id).first()
    if found is None:
        raise NotFound(f"no approval request {request_id}")
    return found
