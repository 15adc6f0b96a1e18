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
from .models import WRITE_ROLES, ApiKey, Membership, Role, Scope

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
        if identity.expired():
            raise exceptions.AuthenticationFailed("the API key has expired")
        ApiKey.objects.filter(pk=identity.key_id).update(last_used_at=timezone.now())
        return KeyPrincipal(identity), identity

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


@dataclass(frozen=True)
class Caller:
    """Who calls the API: a member acting in one tenant, or an API key acting as its creator
    (``key_id`` set, ``scopes`` the key's; ``role`` the creator's current role there, capped
    to viewer without the deploy scope, and "" when the creator is no longer a member)."""

    tenant_id: int
    role: str
    user_id: int | None
    key_id: int | None = None
    scopes: frozenset[str] | None = None  # None: a signed-in person, bounded by role alone
    label: str = ""


NO_OWNER = "this key has no owner in this tenant"


class CallerRequest(Request):
    """For type checking only: a request that passed ``TenantRolePermission``, which sets
    ``caller`` on it. Views behind that permission take their request as this type."""

    caller: Caller


def key_caller(identity: KeyIdentity) -> Caller:
    """The caller behind a key: the person who created it, with the role they hold in the key's
    tenant now (so a demoted or departed creator's keys lose their power at once)."""
    membership = (
        Membership.objects.filter(tenant_id=identity.tenant_id, user_id=identity.created_by_id)
        .select_related("user")
        .first()
        if identity.created_by_id is not None
        else None
    )
    label = f"api-key:{identity.key_id}"
    if membership is None:
        return Caller(identity.tenant_id, "", None, identity.key_id, identity.scopes, label)
    # An inference-only key reads at most, whatever its creator may do.
    writes = identity.scopes & {Scope.DEPLOY, Scope.ADMIN}
    role = membership.role if writes else Role.VIEWER
    label = f"{label} ({membership.user.get_username()})"
    return Caller(
        identity.tenant_id, role, membership.user_id, identity.key_id, identity.scopes, label
    )


def caller_of(request: Request) -> Caller:
    """The tenant and role a request acts as; an API key acts as its creator (``key_caller``).

    A signed-in user acts in the tenant named by the ``X-Tenant`` header (a slug; for reads,
    also the ``tenant`` query parameter), or in their only tenant.
    """
    user = request.user
    if isinstance(user, KeyPrincipal):
        return key_caller(user.identity)
    if not user or not user.is_authenticated:
        # No credentials (DRF leaves the user None): refused like a user of no tenant.
        raise exceptions.PermissionDenied("you are not a member of this tenant")
    memberships = Membership.objects.filter(user=user).select_related("tenant")
    slug = request.headers.get("X-Tenant")
    if not slug and request.method in permissions.SAFE_METHODS:
        # A link (the audit page's export) cannot send a header: a read may name its tenant
        # in the query string.
        slug = request.query_params.get("tenant")
    if slug:
        memberships = memberships.filter(tenant__slug=slug)
    found = list(memberships[:2])
    if not found:
        raise exceptions.PermissionDenied("you are not a member of this tenant")
    if len(found) > 1:
        raise exceptions.ValidationError(
            {"X-Tenant": "you belong to several tenants; name one in the X-Tenant header"}
        )
    return Caller(found[0].tenant_id, found[0].role, user.pk, label=user.get_username())


def require_scope(caller: Caller, scope: str) -> None:
    """403 naming the scope when the caller is a key without it (people are bounded by role)."""
    if caller.scopes is not None and scope not in caller.scopes:
        raise exceptions.PermissionDenied(f"this API key lacks the '{scope}' scope")


class TenantRolePermission(permissions.BasePermission):
    """Members read; engineers and approvers write. A key reads with any scope and writes with
    the view's ``write_scope`` (``deploy`` unless the view says otherwise) as its creator's
    current role; a key whose creator is not a member of its tenant any more cannot write."""

    message = "your role in this tenant does not allow changes"

    def has_permission(self, request: Request, view: APIView) -> bool:
        caller = caller_of(request)
        # From here on the views read this request as a CallerRequest.
        cast(CallerRequest, request).caller = caller
        if request.method in permissions.SAFE_METHODS:
            return True
        scope = getattr(view, "write_scope", Scope.DEPLOY)
        require_scope(caller, scope)
        if caller.key_id is not None and not caller.role:
            raise exceptions.PermissionDenied(NO_OWNER)
        if caller.key_id is not None and scope == Scope.PREDICT:
            return True  # data sent alongside inference (feedback): the scope is the grant
        return caller.role in WRITE_ROLES


class KeyAdminPermission(permissions.BasePermission):
    """API-key management: signed-in engineers and approvers, or a key with the ``admin``
    scope acting for one (what each may give is ``tenants.keys.check_grant``'s rule)."""

    message = "only engineers and approvers manage API keys"

    def has_permission(self, request: Request, view: APIView) -> bool:
        caller = caller_of(request)
        cast(CallerRequest, request).caller = caller
        require_scope(caller, Scope.ADMIN)
        if caller.key_id is not None and not caller.role:
            raise exceptions.PermissionDenied(NO_OWNER)
        return caller.role in WRITE_ROLES


def actor_of(request: CallerRequest) -> Actor:
    """The caller as an actor: a user with their tenant role, or an API key acting as the person
    who created it (their user id, so the four-eyes rule sees through the key; ``via_key``)."""
    caller = request.caller
    return Actor(caller.user_id, caller.label or str(request.user), caller.role, caller.key_id)
