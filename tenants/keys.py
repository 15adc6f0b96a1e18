"""API key creation, revocation and lookup (keys are stored hashed, see platform_site.tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from platform_site.tokens import hash_token, new_token, token_matches, token_prefix

from .audit import SYSTEM, Actor, audit
from .models import DEFAULT_MAX_IN_FLIGHT, ApiKey, KeyPriority, Quota, Tenant

KEY_KIND = "sy"
DEFAULT_QUOTA = Quota(requests_per_second=100.0, burst=200)


@dataclass(frozen=True)
class KeyIdentity:
    """What a valid key tells the data path: the key, its tenant and the tenant's quota."""

    key_id: int
    tenant_id: int
    tenant_slug: str
    rate: float
    burst: int
    max_streams: int = 8
    tokens_per_minute: int = 60_000
    priority: int = KeyPriority.INTERACTIVE  # the key's default and best scheduling class
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # the key's requests at once, per process


def create_api_key(
    tenant: Tenant,
    name: str,
    actor: Actor = SYSTEM,
    priority: int = KeyPriority.INTERACTIVE,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> tuple[ApiKey, str]:
    """Create a key, audited; the raw key is returned once and never stored."""
    prefix, raw = new_token(KEY_KIND)
    with transaction.atomic():
        key = ApiKey.objects.create(
            tenant=tenant,
            name=name,
            prefix=prefix,
            key_hash=hash_token(raw),
            created_by_id=actor.user_id,
            priority=priority,
            max_in_flight=max_in_flight,
        )
        after = {
            "name": name,
            "prefix": prefix,
            "priority": KeyPriority(priority).label,
            "max_in_flight": max_in_flight,
        }
        audit(tenant.pk, actor, "key.create", _target(key), after=after)
    return key, raw


def revoke_api_key(key: ApiKey, actor: Actor = SYSTEM) -> ApiKey:
    """Revoke a key, audited; the gateways stop accepting it within their refresh interval."""
    with transaction.atomic():
        # Row lock: two concurrent revocations keep the first revocation time.
        locked = ApiKey.objects.select_for_update().get(pk=key.pk)
        if locked.revoked_at is None:
            locked.revoked_at = timezone.now()
            locked.save(update_fields=["revoked_at"])  # save() so change signals fire
            after = {"revoked_at": locked.revoked_at.isoformat()}
            audit(locked.tenant_id, actor, "key.revoke", _target(locked), {}, after)
    return locked


def set_key_priority(key: ApiKey, priority: int, actor: Actor = SYSTEM) -> ApiKey:
    """Change a key's scheduling class (its default and ceiling), audited; the gateways use
    it within their refresh interval."""
    with transaction.atomic():
        # Row lock: two concurrent changes each audit the value they replaced.
        locked = ApiKey.objects.select_for_update().get(pk=key.pk)
        before = KeyPriority(locked.priority).label
        if locked.priority != priority:
            locked.priority = priority
            locked.save(update_fields=["priority"])  # save() so change signals fire
            after = {"priority": KeyPriority(priority).label}
            audit(
                locked.tenant_id,
                actor,
                "key.priority",
                _target(locked),
                {"priority": before},
                after,
            )
    return locked


def set_key_max_in_flight(key: ApiKey, max_in_flight: int, actor: Actor = SYSTEM) -> ApiKey:
    """Change how many requests of a key each gateway process serves at once, audited; the
    gateways use it within their refresh interval."""
    with transaction.atomic():
        # Row lock: two concurrent changes each audit the value they replaced.
        locked = ApiKey.objects.select_for_update().get(pk=key.pk)
        before = locked.max_in_flight
        if before != max_in_flight:
            locked.max_in_flight = max_in_flight
            locked.full_clean(validate_unique=False)  # the field's bounds
            locked.save(update_fields=["max_in_flight"])  # save() so change signals fire
            audit(
                locked.tenant_id,
                actor,
                "key.max_in_flight",
                _target(locked),
                {"max_in_flight": before},
                {"max_in_flight": max_in_flight},
            )
    return locked


def _target(key: ApiKey) -> str:
    return f"api key {key.name!r} (sy_{key.prefix}_…)"


def identify_key(raw: str) -> KeyIdentity | None:
    """The identity behind an active key, or None (unknown, malformed or revoked)."""
    prefix = token_prefix(raw, KEY_KIND)
    if prefix is None:
        return None
    row = (
        ApiKey.objects.select_related("tenant", "tenant__quota")
        .filter(prefix=prefix, revoked_at__isnull=True)
        .first()
    )
    if row is None or not token_matches(raw, row.key_hash):
        return None
    return tenant_identity(
        row.tenant, key_id=row.pk, priority=row.priority, max_in_flight=row.max_in_flight
    )


def tenant_identity(
    tenant: Tenant,
    key_id: int = 0,
    priority: int = KeyPriority.INTERACTIVE,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> KeyIdentity:
    """What the data path knows of a tenant: its id, slug and quota (the default if unset)."""
    quota = getattr(tenant, "quota", None) or DEFAULT_QUOTA
    return KeyIdentity(
        key_id=key_id,
        tenant_id=tenant.pk,
        tenant_slug=tenant.slug,
        rate=quota.requests_per_second,
        burst=quota.burst,
        max_streams=quota.max_concurrent_streams,
        tokens_per_minute=quota.tokens_per_minute,
        priority=priority,
        max_in_flight=max_in_flight,
    )


def record_key_use(last_used: dict[int, datetime]) -> None:
    """Write last-used times gathered in memory by the data path (kept off the request path)."""
    for key_id, when in last_used.items():
        ApiKey.objects.filter(pk=key_id).update(last_used_at=when)
