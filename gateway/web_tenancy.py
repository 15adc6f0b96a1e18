"""Which tenant a signed-in user is looking at in the web UI: one of their memberships, kept in
the session, so every page and the live socket show that tenant's data only."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from tenants.keys import KeyIdentity, tenant_identity
from tenants.models import Membership, Role, Tenant

SESSION_KEY = "ui_tenant_id"
WRITE_ROLES = {Role.ENGINEER, Role.APPROVER}


def memberships_of(user) -> list[Membership]:
    memberships = list(
        Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__slug")
    )
    if not memberships and user.is_superuser:
        # A superuser in no tenant may look at any, read-only: the admin shows them all of it
        # anyway. The rows are never saved, so nothing is granted (the API still refuses them).
        tenants = Tenant.objects.order_by("slug")
        return [Membership(tenant=t, user=user, role=Role.VIEWER) for t in tenants]
    return memberships


def current_membership(user, session) -> Membership | None:
    """The membership chosen in the session, else the user's first; None without any."""
    memberships = memberships_of(user)
    chosen = session.get(SESSION_KEY)
    for membership in memberships:
        if membership.tenant_id == chosen:
            return membership
    return memberships[0] if memberships else None


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


def can_write(membership: Membership) -> bool:
    return membership.role in WRITE_ROLES


def session_identity(user, session) -> KeyIdentity | None:
    """The data-path identity of a signed-in user acting in their session's tenant (the UI's
    playground): the tenant's quota, as one of its API keys would carry it."""
    membership = current_membership(user, session)
    if membership is None:
        return None
    return tenant_identity(membership.tenant)
