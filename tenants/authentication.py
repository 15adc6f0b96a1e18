"""DRF authentication by tenant API key, and the tenant/role of any API caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from django.utils import timezone
from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from platform_site.tokens import bearer

from .audit import Actor
from .keys import KeyIdentity, identify_key
from .models import WRITE_ROLES, ApiKey, Membership, Role

if TYPE_CHECKING:
    # Only for annotations: DRF's settings import this module while rest_framework.views loads.
    from rest_framework.views import APIView


@dataclass(frozen=True)
class KeyPrincipal:
    """The ``request.user`` of a call made with an API key."""

    identity: KeyIdentity
    is_authenticated: bool = True
    is_staff: bool = False
    pk: None = None

    def __str__(self) -> str:
        return f"api-key:{self.identity.key_id}"


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer sy_…``: the control-plane API (not the hot path) checks the DB."""

    def authenticate(self, request: Request) -> tuple[KeyPrincipal, KeyIdentity] | None:
        raw = bearer(request.META.get("HTTP_AUTHORIZATION"))
        if raw is None:
            return None
        identity = identify_key(raw)
        if identity is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        ApiKey.objects.filter(pk=identity.key_id).update(last_used_at=timezone.now())
        return KeyPrincipal(identity), identity

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


@dataclass(frozen=True)
class Caller:
    tenant_id: int
    role: str
    user_id: int | None


class CallerRequest(Request):
    """For type checking only: a request that passed ``TenantRolePermission``, which sets
    ``caller`` on it. Views behind that permission take their request as this type."""

    caller: Caller


def caller_of(request: Request) -> Caller:
    """The tenant and role a request acts as; API keys act as engineers of their tenant.

    A signed-in user acts in the tenant named by the ``X-Tenant`` header (a slug), or in their
    only tenant.
    """
    user = request.user
    if isinstance(user, KeyPrincipal):
        return Caller(user.identity.tenant_id, Role.ENGINEER, None)
    if not user or not user.is_authenticated:
        # No credentials (DRF leaves the user None): refused like a user of no tenant.
        raise exceptions.PermissionDenied("you are not a member of this tenant")
    memberships = Membership.objects.filter(user=user).select_related("tenant")
    slug = request.headers.get("X-Tenant")
    if slug:
        memberships = memberships.filter(tenant__slug=slug)
    found = list(memberships[:2])
    if not found:
        raise exceptions.PermissionDenied("you are not a member of this tenant")
    if len(found) > 1:
        raise exceptions.ValidationError(
            {"X-Tenant": "you belong to several tenants; name one in the X-Tenant header"}
        )
    return Caller(found[0].tenant_id, found[0].role, user.pk)


class TenantRolePermission(permissions.BasePermission):
    """Members read; engineers and approvers (and API keys) write."""

    message = "your role in this tenant does not allow changes"

    def has_permission(self, request: Request, view: APIView) -> bool:
        caller = caller_of(request)
        # From here on the views read this request as a CallerRequest.
        cast(CallerRequest, request).caller = caller
        return request.method in permissions.SAFE_METHODS or caller.role in WRITE_ROLES


def actor_of(request: CallerRequest) -> Actor:
    """The caller as an actor: a user with their tenant role, or an API key (no user)."""
    caller = request.caller
    label = str(request.user) if caller.user_id is None else request.user.get_username()
    return Actor(caller.user_id, label, caller.role)
