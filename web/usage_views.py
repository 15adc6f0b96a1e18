"""The usage page: a tenant's usage and cost per day and per model/version over a window (Plotly
charts and tables, CSV export), its monthly budget with an approver's override button, and for
the platform's operators (staff) the same across every tenant (``?all=1``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.http import HttpResponse
from django.shortcuts import redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from monitoring import budgets, usage
from platform_site.errors import Forbidden, Invalid
from tenants.audit import user_actor
from tenants.models import Role

from .pages import TenantRequest, page, tenant_view


def usage_context(request: TenantRequest, errors: dict[str, str] | None = None) -> dict[str, Any]:
    tenant = request.membership.tenant
    everyone = request.GET.get("all") == "1" and request.user.is_staff
    try:
        window = usage.parse_window(request.GET)
    except Invalid as exc:
        errors = {**(errors or {}), exc.field: str(exc)}
        window = usage.parse_window({})
    rows = usage.usage_in(None if everyone else tenant.pk, window)
    query = f"start={window.start}&end={window.end}"
    export = f"/api/v1/usage/export?format=csv&{query}"
    export += "&all=1" if everyone else f"&tenant={tenant.slug}"
    budget = budgets.budget_of(tenant.pk)
    return {
        "everyone": everyone,
        "is_staff": request.user.is_staff,
        "window": window,
        "by_day": usage.grouped(rows, "day", by_tenant=everyone),
        "by_version": usage.grouped(rows, "version", by_tenant=everyone),
        "total": usage.totals(rows),
        "series": usage.chart_series(rows),
        "export_url": export,
        "budget": budget,
        "budget_state": None if budget is None else budgets.snapshot(budget),
        "spent": budgets.spent_in(tenant.pk, budgets.month_of(budgets.utc_today())),
        "month_end": budgets.month_end(timezone.now()),
        "can_override": request.membership.role == Role.APPROVER,
        "errors": errors or {},
    }


def as_utc(text: str) -> str:
    """A ``datetime-local`` value (no zone) read as UTC, like every time the UI shows; any
    other text is passed on for the domain function to refuse."""
    try:
        when = datetime.fromisoformat(text.strip()[:64])
    except ValueError:
        return text
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).isoformat()


@tenant_view
def usage_page(request: TenantRequest) -> HttpResponse:
    return page(request, "usage.html", usage_context(request))


@tenant_view
@require_POST
def override_budget(request: TenantRequest) -> HttpResponse:
    """The budget section's override button (approvers): ``monitoring.budgets.override``,
    audited there."""
    actor = user_actor(request.user, request.membership.role)
    try:
        budgets.override(
            request.membership.tenant_id,
            actor,
            request.POST.get("reason", ""),
            as_utc(request.POST.get("until", "")),
        )
    except Invalid as exc:
        return page(request, "usage.html", usage_context(request, {exc.field: str(exc)}), 400)
    except Forbidden as exc:
        return HttpResponse(str(exc), status=403)
    return redirect("/usage/")
