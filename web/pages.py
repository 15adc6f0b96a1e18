"""What every page of the web UI shares: the tenant it shows (``tenant_view``, from the
signed-in person's memberships and the session) and the layout's context (``page``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from monitoring.alerts import open_alerts
from rollouts.approvals import pending_count
from tenants.members import can_write, current_membership, memberships_of


def tenant_view(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Sign-in required; sets ``request.membership`` (and ``request.memberships``) or shows
    the "no tenant" page."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        request.memberships = memberships_of(request.user)
        request.membership = current_membership(request.user, request.session)
        if request.membership is None:
            return render(request, "no_tenant.html", status=403)
        return view(request, *args, **kwargs)

    return wrapper


def page(request: HttpRequest, template: str, context: dict) -> HttpResponse:
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
    )
