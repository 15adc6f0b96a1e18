"""The API keys page: the tenant's keys, a form to create one (its raw value shown once, in the
response to the form itself), and revoke and rotate buttons. Each action is one call to the
audited functions of ``tenants.keys``, with the same rule as the API on who may give what."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.http import HttpResponse
from django.shortcuts import redirect
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_POST

from platform_site.errors import Conflict, Forbidden, Invalid
from tenants.audit import user_actor
from tenants.keys import (
    DEFAULT_ROTATION_OVERLAP_S,
    MAX_ROTATION_OVERLAP_S,
    check_grant,
    create_api_key,
    grantable_scopes,
    key_for,
    keys_of,
    revoke_api_key,
    rotate_api_key,
)
from tenants.models import SCOPES

from .pages import TenantRequest, page, tenant_view


def _keys_page(
    request: TenantRequest,
    status: int = 200,
    error: str = "",
    shown: tuple[str, str] | None = None,
) -> HttpResponse:
    role = request.membership.role
    response = page(
        request,
        "keys.html",
        {
            "keys": keys_of(request.membership.tenant_id),
            "scopes": SCOPES,
            "grantable": sorted(grantable_scopes(role)),
            "error": error,
            "shown": shown,  # (the key's name, its raw value): this response only
            "default_overlap_h": DEFAULT_ROTATION_OVERLAP_S // 3600,
            "max_overlap_h": MAX_ROTATION_OVERLAP_S // 3600,
        },
    )
    response.status_code = status
    if shown:
        response["Cache-Control"] = "no-store"
    return response


@tenant_view
def keys(request: TenantRequest) -> HttpResponse:
    return _keys_page(request)


def _expiry(text: str) -> datetime | None:
    """An ``<input type="datetime-local">`` value, read in the server's time zone (UTC, as the
    page says); empty for a key that never expires."""
    if not text.strip():
        return None
    when = parse_datetime(text.strip())
    if when is None:
        raise Invalid("expires_at", f"not a date and time: {text[:40]!r}")
    return timezone.make_aware(when) if timezone.is_naive(when) else when


def _refused(request: TenantRequest, exc: Exception) -> HttpResponse:
    if isinstance(exc, Forbidden):
        return _keys_page(request, 403, str(exc))
    if isinstance(exc, Conflict):
        return _keys_page(request, 409, str(exc))
    field = getattr(exc, "field", "")
    return _keys_page(request, 400, f"{field}: {exc}" if field else str(exc))


@tenant_view
@require_POST
def create_key(request: TenantRequest) -> HttpResponse:
    membership = request.membership
    name = request.POST.get("name", "").strip()
    wanted = request.POST.getlist("scopes")
    try:
        if not name or len(name) > 100:
            raise Invalid("name", "give the key a name of 1 to 100 characters")
        check_grant(membership.role, wanted)
        key, raw = create_api_key(
            membership.tenant,
            name,
            user_actor(request.user, membership.role),
            scopes=wanted,
            expires_at=_expiry(request.POST.get("expires_at", "")),
        )
    except (Invalid, Forbidden) as exc:
        return _refused(request, exc)
    return _keys_page(request, 201, shown=(key.name, raw))


@tenant_view
@require_POST
def revoke_key(request: TenantRequest, key_id: int) -> HttpResponse:
    membership = request.membership
    key = key_for(membership.tenant_id, key_id)
    try:
        check_grant(membership.role, key.scopes)
    except Forbidden as exc:
        return _refused(request, exc)
    revoke_api_key(key, user_actor(request.user, membership.role))
    return redirect("keys")


@tenant_view
@require_POST
def rotate_key(request: TenantRequest, key_id: int) -> HttpResponse:
    membership = request.membership
    key = key_for(membership.tenant_id, key_id)
    hours = request.POST.get("overlap_h", "").strip() or str(DEFAULT_ROTATION_OVERLAP_S // 3600)
    try:
        check_grant(membership.role, key.scopes)
        if not hours.isascii() or not hours.isdigit():
            raise Invalid("overlap_h", f"a whole number of hours, got {hours[:20]!r}")
        overlap = timedelta(hours=int(hours[:6])).total_seconds()
        new, raw = rotate_api_key(key, user_actor(request.user, membership.role), overlap)
    except (Invalid, Forbidden, Conflict) as exc:
        return _refused(request, exc)
    return _keys_page(request, 201, shown=(new.name, raw))
