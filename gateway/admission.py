"""Admission: who calls (the API key, its scope and expiry), whether they may now (the tenant's
budget stop, rate limit and the key's in-flight limit), what they call (the model and version
or alias, resolved from the cached route table) and the hold on their Idempotency-Key. Every
front door admits a request through these before any work is done, and an open stream's key
is checked again through ``recheck_key`` and ``watch_key``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings

from platform_site.errors import Conflict, Invalid, Unprocessable
from platform_site.tokens import bearer
from registry.models import ALIAS_NAME
from tenants.keys import KeyIdentity
from tenants.models import Scope
from tenants.ratelimit import retry_after_header

from . import idempotency
from .dispatch import DispatchError
from .errors import ApiError, api_error, ascii_int, shown
from .metrics import Observed
from .routes import DEFAULT_ALIAS, Route, RouteMissing
from .state import GatewayState

PREDICT = Scope.PREDICT.value  # every front door serves inference: the scope each call needs
# A budget stop lasts until an approver's override or the next month: retrying soon is futile.
BUDGET_RETRY_AFTER_S = 3600


async def authenticate(state: GatewayState, authorization: str | None) -> KeyIdentity:
    raw = bearer(authorization)
    if raw is None:
        raise ApiError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            [("WWW-Authenticate", "Bearer")],
        )
    try:
        identity = await state.identify(raw)
    except DispatchError as exc:  # the key is not cached and the database did not answer
        raise api_error(exc) from None
    if identity is None:
        raise ApiError(401, "invalid or revoked API key", [("WWW-Authenticate", "Bearer")])
    # Both from the cached identity: no database query on a warm request.
    if identity.expired():
        raise ApiError(401, "the API key has expired", [("WWW-Authenticate", "Bearer")])
    if PREDICT not in identity.scopes:
        raise ApiError(403, f"this API key lacks the '{PREDICT}' scope")
    return identity


async def recheck_key(state: GatewayState, raw_key: str) -> KeyIdentity | None:
    """An open stream's key, checked again against the key cache (which drops a revoked key
    within a refresh interval): its identity now, or None when the database does not answer
    (the key was valid when last seen: an outage does not cut streams off). Raises 401 once the
    key is revoked or has expired: every stream it holds must end."""
    try:
        identity = await state.identify(raw_key, used=False)
    except DispatchError:
        return None
    if identity is None:
        raise ApiError(401, "the API key was revoked")
    if identity.expired():
        raise ApiError(401, "the API key has expired")
    return identity


async def watch_key(state: GatewayState, raw_key: str) -> ApiError:
    """Re-check an open stream's key every ``SWITCHYARD_STREAM_KEY_RECHECK_S`` until it is
    revoked or expires, and return why. Both streaming doors run it beside their streams (the
    generation websocket, OpenAI's server-sent events), so no stream outlives its key by more
    than that interval plus the key cache's refresh interval."""
    while True:
        await asyncio.sleep(settings.SWITCHYARD_STREAM_KEY_RECHECK_S)
        try:
            await recheck_key(state, raw_key)
        except ApiError as exc:
            return exc


def check_budget(state: GatewayState, identity: KeyIdentity) -> None:
    """429 naming the budget when the tenant's hard stop refuses new work (from the cached
    set the refresh loop rereads every few seconds: no query)."""
    stop = state.budget_stops.get(identity.tenant_id)
    if stop is not None:
        raise ApiError(429, stop, [("Retry-After", str(BUDGET_RETRY_AFTER_S))])


async def rate_limit(state: GatewayState, identity: KeyIdentity) -> None:
    wait = await state.limiter.acquire(identity.tenant_id, identity.rate, identity.burst)
    if wait is not None:
        raise ApiError(
            429,
            f"rate limit exceeded for tenant {identity.tenant_slug!r} "
            f"({identity.rate:g} requests/s, burst {identity.burst})",
            [("Retry-After", retry_after_header(wait))],
        )


def parse_version(version: str | None) -> int | str:
    """What a request's version segment names: a version number (a positive integer), else an
    alias name (validated as the registry validates alias names, which are never only
    digits); none at all names the ``production`` alias."""
    if version is None or version == "":
        return DEFAULT_ALIAS
    number = ascii_int(version)
    if number is not None:
        if number < 1:
            raise ApiError(400, f"version must be a positive integer, got {shown(version)}")
        return number
    if ALIAS_NAME.fullmatch(version) is None:
        raise ApiError(
            400,
            f"version must be a positive integer or an alias name (lowercase letters, digits, "
            f"'.', '_', '-', at most 50), got {shown(version)}",
        )
    return version


def model_ref(ref: str) -> tuple[str, str | None]:
    """``name@alias`` (or ``name@3``) as the model name and version segment, for the doors
    that take one string (OpenAI's ``model``, the generation websocket's path). ``@`` cannot
    appear in a model name (``registry.models.name_validator``)."""
    name, at, version = ref.partition("@")
    return name, (version if at else None)


async def resolve(
    state: GatewayState, identity: KeyIdentity, model_name: str, version: str | None
) -> Route:
    try:
        return await state.route(identity.tenant_id, model_name, parse_version(version))
    except RouteMissing as exc:
        raise ApiError(404, str(exc)) from None
    except DispatchError as exc:
        raise api_error(exc) from None


async def admit(
    state: GatewayState,
    authorization: str | None,
    model_name: str,
    version: str | None,
    observed: Observed | None = None,
) -> tuple[KeyIdentity, Route]:
    """Authenticate, rate-limit and resolve: every request goes through this first."""
    identity = await authenticate(state, authorization)
    if observed is not None:
        observed.tenant = identity.tenant_slug
        observed.mark("auth")
    await rate_limit(state, identity)
    if observed is not None:
        observed.mark("rate_limit")
    route = await resolve(state, identity, model_name, version)
    if observed is not None:
        observed.route = route
        observed.mark("routing")
    return identity, route


async def claim_key(
    state: GatewayState,
    identity: KeyIdentity,
    value: str | None,
    method: str,
    path: str,
    *body: bytes,
) -> idempotency.Claim | None:
    """A request's hold on its ``Idempotency-Key`` (None without the header; see
    ``gateway.idempotency.claim``), refusals as ``ApiError``: a malformed key 400, a key
    whose first request still runs 409, a key used for another request 422."""
    try:
        return await idempotency.claim(
            state.answers, identity.tenant_id, identity.key_id, value, method, path, *body
        )
    except Invalid as exc:
        raise ApiError(400, f"{exc.field}: {exc}") from None
    except Conflict as exc:
        raise ApiError(409, str(exc), [("Retry-After", "1")]) from None
    except Unprocessable as exc:
        raise ApiError(422, str(exc)) from None


IN_FLIGHT_RETRY_AFTER_S = 1


def hold_in_flight(state: GatewayState, identity: KeyIdentity) -> None:
    """Count a request against its key's ``max_in_flight`` in this process, or refuse it with
    429 at once: a client that opens more requests than its key allows waits for none of them.
    Every successful call is paired with ``release_in_flight``."""
    if not state.in_flight.enter((identity.tenant_id, identity.key_id), identity.max_in_flight):
        raise ApiError(
            429,
            f"too many requests in flight for this API key (at most {identity.max_in_flight} "
            "at once per gateway process); retry when one has been answered",
            [("Retry-After", str(IN_FLIGHT_RETRY_AFTER_S))],
        )


def release_in_flight(state: GatewayState, identity: KeyIdentity) -> None:
    state.in_flight.leave((identity.tenant_id, identity.key_id))


@contextmanager
def in_flight(state: GatewayState, identity: KeyIdentity) -> Iterator[None]:
    """Hold one of the key's in-flight places while the block runs (see ``hold_in_flight``)."""
    hold_in_flight(state, identity)
    try:
        yield
    finally:
        release_in_flight(state, identity)
