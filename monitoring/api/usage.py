"""Usage, prices and budgets over the API. Members read their tenant's usage; approvers set its
prices and budget and override a hard stop; operators (Django staff, signed in) read every
tenant's usage (``all=1``) and set the platform's default prices (``default=1``)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any, cast

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import permissions
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import ExportFormatParam
from platform_site.errors import Invalid
from platform_site.parsers import JSONBodyParser
from tenants.audit import Actor, user_actor
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of
from tenants.models import Scope

from .. import budgets, usage
from ..models import Budget

WINDOW = [
    OpenApiParameter("start", OpenApiTypes.DATE, description="first day (UTC); 29 days ago"),
    OpenApiParameter("end", OpenApiTypes.DATE, description="last day (UTC), default today"),
]
ALL = OpenApiParameter("all", OpenApiTypes.BOOL, description="every tenant (operators only)")


def _flag(request: Request, name: str) -> bool:
    return str(request.query_params.get(name, "")).lower() in ("1", "true", "yes")


def _operator(request: Request) -> bool:
    """A signed-in Django staff user (an API key is never an operator)."""
    user = request.user
    return bool(user and user.is_authenticated and getattr(user, "is_staff", False))


class OperatorOrTenantPermission(permissions.BasePermission):
    """With the view's operator flag (``all=1`` or ``default=1``): operators only, no tenant
    needed. Without: ``TenantRolePermission`` (members read, writes as the view says)."""

    message = "only the platform's operators (staff) may do this"

    def has_permission(self, request: Request, view: APIView) -> bool:
        if _flag(request, getattr(view, "operator_flag", "all")):
            return _operator(request)
        return TenantRolePermission().has_permission(request, view)


def _scope(request: Request) -> int | None:
    """Whose usage: the caller's tenant, or everyone's for an operator asking ``all=1``."""
    if _flag(request, "all"):
        return None
    return cast(CallerRequest, request).caller.tenant_id


class UsageView(APIView):
    """Usage and cost summed per day, model or version over a window of days."""

    permission_classes = [OperatorOrTenantPermission]

    @extend_schema(
        parameters=[
            *WINDOW,
            OpenApiParameter("group", OpenApiTypes.STR, enum=list(usage.GROUPS)),
            ALL,
        ],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request: Request) -> Response:
        window = usage.parse_window(request.query_params)
        group = request.query_params.get("group", "day")
        if group not in usage.GROUPS:
            raise Invalid("group", f"one of {', '.join(usage.GROUPS)}")
        tenant_id = _scope(request)
        rows = usage.usage_in(tenant_id, window)
        return Response(
            {
                "start": window.start.isoformat(),
                "end": window.end.isoformat(),
                "group": group,
                "rows": usage.grouped(rows, group, by_tenant=tenant_id is None),
                "total": usage.totals(rows),
            }
        )


class UsageExportView(ExportFormatParam, APIView):
    """Usage per tenant, day and version as CSV (a header row first)."""

    permission_classes = [OperatorOrTenantPermission]

    @extend_schema(
        parameters=[*WINDOW, OpenApiParameter("format", OpenApiTypes.STR, enum=["csv"]), ALL],
        responses={(200, "text/csv"): OpenApiTypes.STR},
    )
    def get(self, request: Request) -> HttpResponse:
        fmt = request.query_params.get("format", "csv")
        if fmt != "csv":
            raise Invalid("format", "csv is the only export format")
        window = usage.parse_window(request.query_params)
        tenant_id = _scope(request)
        body = b"".join(usage.export_csv(usage.usage_in(tenant_id, window)))
        response = HttpResponse(body, content_type="text/csv")
        who = "all-tenants" if tenant_id is None else f"tenant-{tenant_id}"
        name = f"usage-{who}-{window.start}-{window.end}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response


def _prices_body(tenant_id: int | None) -> dict[str, Any]:
    def shown(prices: dict[str, Decimal]) -> dict[str, str]:
        return {r: str(p) for r, p in sorted(prices.items())}

    body: dict[str, Any] = {"defaults": shown(usage.prices_of(None))}
    if tenant_id is not None:
        body["prices"] = shown(usage.prices_of(tenant_id))
        body["effective"] = shown(usage.effective_prices(tenant_id))
    return body


class PricesView(APIView):
    """The tenant's unit prices per resource, the platform's defaults, and what applies.
    PUT ``{"prices": {resource: price or null}}``: approvers set their tenant's (a key needs
    the admin scope); with ``?default=1`` operators set the defaults."""

    permission_classes = [OperatorOrTenantPermission]
    parser_classes = [JSONBodyParser]
    operator_flag = "default"
    write_scope = Scope.ADMIN

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        if _flag(request, "default"):
            return Response(_prices_body(None))
        return Response(_prices_body(cast(CallerRequest, request).caller.tenant_id))

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def put(self, request: Request) -> Response:
        data = request.data
        if not isinstance(data, dict) or "prices" not in data:
            raise Invalid("prices", "send {'prices': {resource: unit price}}")
        if _flag(request, "default"):
            actor: Actor = user_actor(request.user, "operator")
            usage.set_prices(None, data["prices"], actor)
            return Response(_prices_body(None))
        caller = cast(CallerRequest, request).caller
        usage.set_prices(caller.tenant_id, data["prices"], actor_of(cast(CallerRequest, request)))
        return Response(_prices_body(caller.tenant_id))


def budget_body(budget: Budget | None, tenant_id: int) -> dict[str, Any]:
    """The budget as the API and the page show it: this month's spend read now."""
    month = budgets.month_of(budgets.utc_today())
    spent = budgets.spent_in(tenant_id, month)
    if budget is None:
        return {"monthly_limit": None, "spent": str(spent), "month": month.isoformat()}
    return {
        **budgets.snapshot(budget),
        "month": month.isoformat(),
        "spent": str(spent),
        "percent": round(float(spent * 100 / budget.monthly_limit), 2),
        "alerted": budget.alerted if budget.month == month else [],
        "override_until": (
            budget.override_until.isoformat() if budget.override_until is not None else None
        ),
    }


class BudgetView(APIView):
    """The tenant's monthly budget. PUT ``{"monthly_limit", "thresholds", "hard_stop"}``:
    approvers (a key needs the admin scope)."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]
    write_scope = Scope.ADMIN

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: CallerRequest) -> Response:
        tenant_id = request.caller.tenant_id
        return Response(budget_body(budgets.budget_of(tenant_id), tenant_id))

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def put(self, request: CallerRequest) -> Response:
        tenant_id = request.caller.tenant_id
        budget = budgets.set_budget(tenant_id, request.data, actor_of(request))
        return Response(budget_body(budget, tenant_id))


class BudgetOverrideView(APIView):
    """An approver lifts the hard stop: ``{"reason", "until"}`` (ISO 8601, at most the
    month's end)."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]
    write_scope = Scope.ADMIN

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request: CallerRequest) -> Response:
        data = request.data if isinstance(request.data, dict) else {}
        tenant_id = request.caller.tenant_id
        budget = budgets.override(
            tenant_id, actor_of(request), data.get("reason"), data.get("until")
        )
        return Response(budget_body(budget, tenant_id))
