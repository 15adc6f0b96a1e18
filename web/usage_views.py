"""The usage page: a tenant's usage and cost per day and per model/version over a window (Plotly
charts and tables, CSV export), when it was last rolled up, its prices and monthly budget (set
by approvers through the API's forms, ``static/ui/usage.js``) with an approver's override
button, and for the platform's operators (staff) the same across every tenant (``?all=1``)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.http import HttpResponse
from django.shortcuts import redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from monitoring import budgets, usage
from monitoring.models import Resource
from platform_site.errors import Forbidden, Invalid
from tenants.audit import user_actor
from tenants.models import Role

from .pages import TenantRequest, page, tenant_view


def money(amount: Decimal | str | int, currency: str) -> str:
    """A cost as people read it: two decimals and the currency ("12.40 USD"); a cost under a
    cent is not shown as free."""
    value = Decimal(amount)
    if 0 < value < Decimal("0.005"):
        return f"< 0.01 {currency}"
    return f"{value:,.2f} {currency}"


def unit_price(price: Decimal, currency: str) -> str:
    """A unit price with as many decimals as it has (at least two): 0.000002 USD per token."""
    whole, _, fraction = f"{price.normalize():f}".partition(".")
    return f"{whole}.{fraction.ljust(2, '0')} {currency}"


def _priced(item: dict[str, Any], pricing: usage.Pricing) -> dict[str, Any]:
    """A grouped row (or the totals) with its cost as shown: ``pricing`` (priced, partly,
    unpriced), ``cost_text`` and the ``unpriced`` resources' labels."""
    return {
        **item,
        "pricing": pricing.state(item),
        "cost_text": money(item["cost"], pricing.currency),
        "unpriced": [Resource(r).label.lower() for r in pricing.missing(item)],
    }


def price_table(tenant_id: int, pricing: usage.Pricing) -> list[dict[str, Any]]:
    """One line per resource: the tenant's own price, the platform's default and what applies
    (``None``: unpriced), as shown and as the approver's form starts."""
    own, defaults = usage.prices_of(tenant_id), usage.prices_of(None)
    lines = []
    for resource in Resource:
        mine, default = own.get(resource.value), defaults.get(resource.value)
        applies = mine if mine is not None else default
        lines.append(
            {
                "resource": resource.value,
                "label": resource.label,
                "own": None if mine is None else unit_price(mine, pricing.currency),
                "own_value": "" if mine is None else f"{mine.normalize():f}",
                "default": None if default is None else unit_price(default, pricing.currency),
                "applies": None if applies is None else unit_price(applies, pricing.currency),
            }
        )
    return lines


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
    spent = budgets.spent_in(tenant.pk, budgets.month_of(budgets.utc_today()))
    pricing = usage.pricing_of(tenant.pk)
    # Every tenant's rows are priced by that tenant's prices; the page's own tenant's otherwise.
    by_tenant = usage.pricing_by_tenant(rows) if everyone else {}

    def priced(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [_priced(i, by_tenant.get(i.get("tenant", ""), pricing)) for i in items]

    by_day = priced(usage.grouped(rows, "day", by_tenant=everyone))
    by_version = priced(usage.grouped(rows, "version", by_tenant=everyone))
    total = usage.totals(rows)
    pricing_total = usage.Pricing.together(by_tenant.values()) if everyone else pricing
    is_approver = request.membership.role == Role.APPROVER
    return {
        "everyone": everyone,
        "is_staff": request.user.is_staff,
        "window": window,
        "by_day": by_day,
        "by_version": by_version,
        "total": _priced(total, pricing_total),
        "any_unpriced": any(r["pricing"] != "priced" for r in by_version),
        "series": usage.chart_series(rows),
        "currency": pricing_total.currency,
        "rolled_up_at": usage.rolled_up_at(rows),
        "rollup_minutes": max(1, round(settings.SWITCHYARD_USAGE_ROLLUP_INTERVAL_S / 60)),
        "export_url": export,
        "prices": price_table(tenant.pk, pricing),
        "price_currency": pricing.currency,
        "budget": budget,
        "budget_state": None if budget is None else budgets.snapshot(budget),
        # Spend is priced in the prices' currency, whatever the budget's (the page warns).
        "spent": money(spent, pricing.currency),
        "limit": None if budget is None else money(budget.monthly_limit, budget.currency),
        "month_end": budgets.month_end(timezone.now()),
        # The rule of ``usage.set_prices`` and ``budgets.set_budget``/``override``: approvers;
        # the API checks it again (and validates) when the forms are sent.
        "can_set_prices": is_approver,
        "can_set_budget": is_approver,
        "can_override": is_approver,
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
