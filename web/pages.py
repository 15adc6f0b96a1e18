"""What every page of the web UI shares: the tenant it shows (``tenant_view``, from the
signed-in person's memberships and the session) and the layout's context (``page``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, cast

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from monitoring.alerts import open_alerts
from rollouts.approvals import pending_count
from tenants.members import can_write, current_membership, memberships_of
from tenants.models import Membership


class TenantRequest(HttpRequest):
    """For type checking only: a request that passed ``tenant_view``, which sets who acts and
    in which tenant (``membership``) and the tenants they may switch to (``memberships``)."""

    membership: Membership
    memberships: list[Membership]


def tenant_view(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Sign-in required; sets ``request.membership`` (and ``request.memberships``) or shows
    the "no tenant" page. The view takes its request as a ``TenantRequest``."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        tenant_request = cast(TenantRequest, request)  # it becomes one here
        tenant_request.memberships = memberships_of(request.user)
        membership = current_membership(request.user, request.session)
        if membership is None:
            return render(request, "no_tenant.html", status=403)
        tenant_request.membership = membership
        return view(tenant_request, *args, **kwargs)

    return wrapper


def page(
    request: TenantRequest, template: str, context: dict[str, Any], status: int = 200
) -> HttpResponse:
    """Render with what the layout needs: the tenant switcher, the role, the inbox count and
    the open alerts' count."""
    membership = request.membership
    return render(
        request,
        template,
        {
            "membership": membership,
            "tenant": membership.tenant,
            "memberships": request.memberships,
            "can_write": can_write(membership),
            "pending_count": pending_count(membership.tenant_id),
            "open_alert_count": open_alerts(membership.tenant_id).count(),
            **context,
        },
        status=status,
    )
