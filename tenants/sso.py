"""Single sign-on (OpenID Connect) for the web UI: the identity provider's group claim decides
the person's tenant roles, synced on every sign-in. Django passwords stay the default; this
backend is only installed when the SSO settings are complete (see docs/sso.md)."""

from __future__ import annotations

import json
import logging
from typing import Any

import jwt
import requests
from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest
from mozilla_django_oidc.auth import OIDCAuthenticationBackend

from .audit import SYSTEM, audit
from .models import Membership, Role, Tenant

logger = logging.getLogger(__name__)


def role_map() -> dict[str, tuple[str, str]]:
    """SWITCHYARD_OIDC_ROLE_MAP: ``{"group": ["tenant-slug", "role"]}``; bad entries refused at
    startup rather than silently granting nothing."""
    raw = json.loads(getattr(settings, "SWITCHYARD_OIDC_ROLE_MAP", "") or "{}")
    mapping: dict[str, tuple[str, str]] = {}
    for group, target in raw.items():
        slug, role = target
        if role not in Role.values:
            raise ValueError(f"SWITCHYARD_OIDC_ROLE_MAP: {group!r} names unknown role {role!r}")
        mapping[str(group)] = (str(slug), str(role))
    return mapping


def wanted_roles(groups: list[str]) -> dict[str, str]:
    """Tenant slug -> role for these groups; of two groups on one tenant the stronger role wins."""
    rank = {Role.VIEWER: 0, Role.ENGINEER: 1, Role.APPROVER: 2}
    wanted: dict[str, str] = {}
    for group in groups:
        if group in role_map():
            slug, role = role_map()[group]
            if slug not in wanted or rank[Role(role)] > rank[Role(wanted[slug])]:
                wanted[slug] = role
    return wanted


def sync_memberships(user: User, groups: list[str]) -> None:
    """Make the user's memberships exactly what their groups map to; each change audited."""
    wanted = wanted_roles(groups)
    with transaction.atomic():
        current = {
            m.tenant.slug: m for m in Membership.objects.filter(user=user).select_related("tenant")
        }
        for slug, membership in current.items():
            if slug not in wanted:
                membership.delete()
                audit(
                    membership.tenant_id,
                    SYSTEM,
                    "sso.membership.removed",
                    user.username,
                    before={"role": membership.role},
                )
            elif membership.role != wanted[slug]:
                before = membership.role
                membership.role = wanted[slug]
                membership.save(update_fields=["role"])
                audit(
                    membership.tenant_id,
                    SYSTEM,
                    "sso.membership.changed",
                    user.username,
                    before={"role": before},
                    after={"role": membership.role},
                )
        for slug, role in wanted.items():
            tenant = Tenant.objects.filter(slug=slug).first()
            if slug in current or tenant is None:
                continue  # a mapping to a tenant that does not exist grants nothing
            Membership.objects.create(tenant=tenant, user=user, role=role)
            audit(tenant.pk, SYSTEM, "sso.membership.added", user.username, after={"role": role})


class SwitchyardOIDCBackend(OIDCAuthenticationBackend):
    """Users are matched by the ``sub`` claim (kept as the username ``oidc:<sub>``), so a changed
    email at the provider does not make a new account."""

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> User | None:
        """A provider that refuses the code exchange (a replayed or foreign code) or cannot be
        reached, or an ID token that fails a check, is a failed sign-in: the callback sends the
        person to the sign-in page again, instead of answering 400 or 500."""
        try:
            user: User | None = super().authenticate(request, **kwargs)
        except (requests.RequestException, SuspiciousOperation) as exc:
            logger.warning("single sign-on refused: %s", exc)
            return None
        return user

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        """The library checks the ID token's signature, expiry and nonce, but not its audience
        or issuer: a token the provider issued to another of its clients, or one from another
        provider whose keys the JWKS serves, would sign a person in. Both are checked here
        (OpenID Connect Core 3.1.3.7); a refusal is a failed sign-in, never a session."""
        try:
            payload: dict[str, Any] = super().verify_token(token, **kwargs)
        except jwt.InvalidTokenError as exc:  # expired, not yet valid, malformed claims
            raise SuspiciousOperation(f"ID token: {exc}") from None
        audience = payload.get("aud")
        audiences = audience if isinstance(audience, list) else [audience]
        client_id = self.OIDC_RP_CLIENT_ID
        if client_id not in audiences:
            raise SuspiciousOperation("ID token: its audience is not this client")
        if len(audiences) > 1 and payload.get("azp") != client_id:
            raise SuspiciousOperation("ID token: several audiences and azp is not this client")
        issuer = getattr(settings, "SWITCHYARD_OIDC_ISSUER", "")
        if issuer and str(payload.get("iss", "")).rstrip("/") != issuer.rstrip("/"):
            raise SuspiciousOperation("ID token: its issuer is not the configured provider")
        return payload

    def filter_users_by_claims(self, claims: dict[str, Any]) -> QuerySet[User]:
        sub = claims.get("sub")
        if not sub:
            return User.objects.none()
        return User.objects.filter(username=f"oidc:{sub}")

    def create_user(self, claims: dict[str, Any]) -> User:
        user = User.objects.create_user(f"oidc:{claims['sub']}", email=claims.get("email", ""))
        return self.update_user(user, claims)

    def update_user(self, user: User, claims: dict[str, Any]) -> User:
        claim = getattr(settings, "SWITCHYARD_OIDC_GROUPS_CLAIM", "groups")
        groups = claims.get(claim) or []
        if not isinstance(groups, list):
            groups = []
        if claims.get("email") and user.email != claims["email"]:
            user.email = claims["email"]
            user.save(update_fields=["email"])
        sync_memberships(user, [str(g) for g in groups])
        return user
