"""Which tenant a signed-in person acts in: one of their memberships, chosen in the session (the
web UI's tenant switcher), so every page, the live socket and the playground's generations act
in that tenant only."""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser, User
from django.contrib.sessions.backends.base import SessionBase

from .keys import KeyIdentity, tenant_identity
from .models import WRITE_ROLES, Membership, Role, Tenant

SESSION_KEY = "ui_tenant_id"


def memberships_of(user: User | AnonymousUser) -> list[Membership]:
    if not user.is_authenticated:
        return []  # a visitor who has not signed in acts in no tenant
    memberships = list(
        Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__slug")
    )
    if not memberships and user.is_superuser:
        # A superuser in no tenant may look at any, read-only: the admin shows them all of it
        # anyway. The rows are never saved, so nothing is granted (the API still refuses them).
        tenants = Tenant.objects.order_by("slug")
        return [Membership(tenant=t, user=user, role=Role.VIEWER) for t in tenants]
    return memberships


def current_membership(user: User | AnonymousUser, session: SessionBase) -> Membership | None:
    """The membership chosen in the session, else the user's first; None without any."""
    memberships = memberships_of(user)
    chosen = session.get(SESSION_KEY)
    for membership in memberships:
        if membership.tenant_id == chosen:
            return membership
    return memberships[0] if memberships else None


def can_write(membership: Membership) -> bool:
    return membership.role in WRITE_ROLES


def session_identity(user: User | AnonymousUser, session: SessionBase) -> KeyIdentity | None:
    """The data-path identity of a signed-in user acting in their session's tenant (the UI's
    playground): the tenant's quota, as one of its API keys would carry it."""
    membership = current_membership(user, session)
    if membership is None:
        return None
    return tenant_identity(membership.tenant)
