"""API key creation, revocation and lookup (keys are stored hashed, see platform_site.tokens)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

# The module, not its names: platform_site.errors imports DRF, whose settings import this
# module (through tenants.authentication) while it loads.
from platform_site import errors
from platform_site.tokens import hash_token, new_token, token_matches, token_prefix

from .audit import SYSTEM, Actor, audit
from .models import (
    DEFAULT_MAX_IN_FLIGHT,
    SCOPES,
    ApiKey,
    KeyPriority,
    Quota,
    Role,
    Scope,
    Tenant,
)

KEY_KIND = "sy"
DEFAULT_QUOTA = Quota(requests_per_second=100.0, burst=200)
# How long a rotated key keeps working next to its successor, unless told: a day for the
# clients to pick up the new key; at most a month, so a rotation always ends the old key.
DEFAULT_ROTATION_OVERLAP_S = 24 * 3600
MAX_ROTATION_OVERLAP_S = 30 * 24 * 3600


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
    # What the key may do (a signed-in session's playground: predict only). Fixed at creation,
    # so a cached identity never carries stale scopes.
    scopes: frozenset[str] = frozenset({Scope.PREDICT})
    # When the key stops working, as time.time() seconds (None: never): the cached identity
    # carries it and each request compares, with no database query.
    expires_ts: float | None = None
    created_by_id: int | None = None  # the person the key acts as

    def expired(self, now: float | None = None) -> bool:
        return self.expires_ts is not None and (time.time() if now is None else now) >= (
            self.expires_ts
        )


def clean_scopes(scopes: Iterable[object]) -> list[str]:
    """The scopes in their canonical order, refusing an empty set and unknown names."""
    given = list(scopes)
    unknown = [s for s in given if s not in SCOPES]
    if unknown:
        raise errors.Invalid("scopes", f"unknown scope(s) {unknown!r}; scopes are {list(SCOPES)}")
    if not given:
        raise errors.Invalid("scopes", f"give at least one scope of {list(SCOPES)}")
    return [s for s in SCOPES if s in given]


def create_api_key(
    tenant: Tenant,
    name: str,
    actor: Actor = SYSTEM,
    priority: int = KeyPriority.INTERACTIVE,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    scopes: Iterable[str] = (Scope.PREDICT,),
    expires_at: datetime | None = None,
    reason: str = "",
) -> tuple[ApiKey, str]:
    """Create a key acting as ``actor``'s person, audited; the raw key is returned once and
    never stored. Who may give which scopes is the caller's check (``grantable_scopes``)."""
    scope_list = clean_scopes(scopes)
    if expires_at is not None and expires_at <= timezone.now():
        raise errors.Invalid("expires_at", "must be in the future")
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
            scopes=scope_list,
            expires_at=expires_at,
        )
        after = {
            "name": name,
            "prefix": prefix,
            "scopes": scope_list,
            "expires_at": expires_at.isoformat() if expires_at else None,
            "priority": KeyPriority(priority).label,
            "max_in_flight": max_in_flight,
        }
        audit(tenant.pk, actor, "key.create", _target(key), after=after, reason=reason)
    return key, raw


def create_key_like(
    template: ApiKey, actor: Actor, expires_at: datetime | None, reason: str = ""
) -> tuple[ApiKey, str]:
    """A new key with the tenant, name, scopes, priority and limits of ``template`` (an
    unsaved form's key, or the key a rotation replaces), audited; its raw value once."""
    return create_api_key(
        template.tenant,
        template.name,
        actor,
        priority=template.priority,
        max_in_flight=template.max_in_flight,
        scopes=template.scopes,
        expires_at=expires_at,
        reason=reason,
    )


def create_derived_key(
    tenant: Tenant,
    name: str,
    context: str,
    actor: Actor = SYSTEM,
    priority: int = KeyPriority.INTERACTIVE,
    scopes: Iterable[str] = (Scope.PREDICT,),
) -> ApiKey:
    """A key whose secret is derived from ``SECRET_KEY`` and ``context`` (e.g.
    ``"switchyard-batch-job:42"``) instead of drawn at random, for a worker of the platform's
    own that acts with it later (``derive_raw_key``): nothing but its hash is stored, as for
    every key, and it is created and audited as every key is."""
    with transaction.atomic():
        # The random secret create_api_key draws is never shown: its hash is replaced by the
        # derived one's in the same transaction, so no other secret ever opens the key.
        key, _ = create_api_key(
            tenant, name, actor, priority=priority, scopes=scopes, reason="derived secret"
        )
        key.key_hash = hash_token(_derived_token(context, key.prefix))
        key.save(update_fields=["key_hash"])
    return key


def derive_raw_key(key: ApiKey, context: str) -> str:
    """The raw value of a key made by ``create_derived_key`` with the same ``context``."""
    return _derived_token(context, key.prefix)


def _derived_token(context: str, prefix: str) -> str:
    digest = hmac.new(
        settings.SECRET_KEY.encode(), f"{context}:{prefix}".encode(), hashlib.sha256
    ).digest()
    # The token format splits on "_": the secret, like new_token's, has none.
    secret = base64.urlsafe_b64encode(digest).decode().rstrip("=").replace("_", "x")
    return f"{KEY_KIND}_{prefix}_{secret}"


def rotate_api_key(
    key: ApiKey,
    actor: Actor = SYSTEM,
    overlap_s: float = DEFAULT_ROTATION_OVERLAP_S,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, str]:
    """Replace a key: a new key with the same name, scopes, priority and limits (expiring at
    ``expires_at``, if given), while the old one keeps working for ``overlap_s`` more seconds
    (never longer than it would have), audited. The new raw key is returned once."""
    if not 0 <= overlap_s <= MAX_ROTATION_OVERLAP_S:
        raise errors.Invalid("overlap_s", f"must be between 0 and {MAX_ROTATION_OVERLAP_S} seconds")
    with transaction.atomic():
        # Row lock: two concurrent rotations of one key would leave two successors.
        old = ApiKey.objects.select_for_update().select_related("tenant").get(pk=key.pk)
        if not old.is_active:
            raise errors.Conflict(f"the key is {old.state}; only an active key can be rotated")
        new, raw = create_key_like(old, actor, expires_at, reason=f"rotation of {_target(old)}")
        ends = timezone.now() + timedelta(seconds=overlap_s)
        before = {"expires_at": old.expires_at.isoformat() if old.expires_at else None}
        if old.expires_at is None or ends < old.expires_at:
            old.expires_at = ends
            old.save(update_fields=["expires_at"])  # save() so change signals fire
        after = {"expires_at": old.expires_at.isoformat(), "successor": new.prefix}
        audit(old.tenant_id, actor, "key.rotate", _target(old), before, after)
    return new, raw


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
    """The identity behind a key that is not revoked, or None (unknown, malformed or revoked).
    An expired key still has one (``expired()`` says so): callers answer it as expired."""
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
    return tenant_identity(row.tenant, key=row)


def tenant_identity(tenant: Tenant, key: ApiKey | None = None) -> KeyIdentity:
    """What the data path knows of a tenant: its id, slug and quota (the default if unset)."""
    quota = getattr(tenant, "quota", None) or DEFAULT_QUOTA
    session = KeyIdentity(
        key_id=0,
        tenant_id=tenant.pk,
        tenant_slug=tenant.slug,
        rate=quota.requests_per_second,
        burst=quota.burst,
        max_streams=quota.max_concurrent_streams,
        tokens_per_minute=quota.tokens_per_minute,
    )
    if key is None:  # a signed-in session (the playground): inference only, the defaults
        return session
    return replace(
        session,
        key_id=key.pk,
        priority=key.priority,
        max_in_flight=key.max_in_flight,
        scopes=frozenset(key.scopes),
        expires_ts=key.expires_at.timestamp() if key.expires_at else None,
        created_by_id=key.created_by_id,
    )


def record_key_use(last_used: dict[int, datetime]) -> None:
    """Write last-used times gathered in memory by the data path (kept off the request path)."""
    for key_id, when in last_used.items():
        ApiKey.objects.filter(pk=key_id).update(last_used_at=when)


def grantable_scopes(role: str, held: Iterable[str] | None = None) -> frozenset[str]:
    """The scopes a member of this role may give a key: none for a viewer, an engineer's own
    powers (predict, deploy), and ``admin`` (keys and tenant settings) only for approvers. No
    one makes a key more powerful than themselves, and no key one more powerful than itself:
    a caller that is an API key (``held``, its scopes) gives only scopes it holds, so a key
    with only ``admin`` cannot mint one that predicts or deploys."""
    if role == Role.APPROVER:
        allowed = frozenset(SCOPES)
    elif role == Role.ENGINEER:
        allowed = frozenset({Scope.PREDICT, Scope.DEPLOY})
    else:
        allowed = frozenset()
    return allowed if held is None else allowed & frozenset(held)


def check_grant(role: str, scopes: Iterable[str], held: Iterable[str] | None = None) -> None:
    """403 (``Forbidden``) unless a member of ``role`` (acting through a key of scopes ``held``,
    if given) may hold a key of these scopes: to create one, or to revoke or rotate one (a
    rotation makes its successor theirs). Every path that creates or widens a key asks here."""
    if not grantable_scopes(role):
        raise errors.Forbidden("your role in this tenant does not allow managing API keys")
    allowed = grantable_scopes(role, held)
    beyond = [s for s in scopes if s not in allowed]
    if beyond:
        who = f"your role ({role})" if held is None else f"this key (scopes {sorted(held)})"
        raise errors.Forbidden(
            f"{who} cannot give or manage the scope(s) {beyond}; it may give {sorted(allowed)}"
        )


def keys_of(tenant_id: int) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant_id=tenant_id).select_related("created_by")


def key_for(tenant_id: int, key_id: int) -> ApiKey:
    """A key of this tenant; another tenant's key is as unknown as none (404)."""
    key = keys_of(tenant_id).filter(pk=key_id).first()
    if key is None:
        raise errors.NotFound(f"no API key {key_id} in this tenant")
    return key
