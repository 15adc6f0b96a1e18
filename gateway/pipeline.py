"""The one pipeline both front doors call: authenticate → rate-limit → resolve → validate →
dispatch. Each step raises ``ApiError`` with the status and a message that names the problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from platform_site.tokens import bearer
from serving_agent.protocol import InferError
from tenants.keys import KeyIdentity
from tenants.ratelimit import retry_after_header

from .dispatch import DispatchError
from .routes import InputSpec, Route, RouteMissing
from .state import GatewayState


@dataclass
class ApiError(Exception):
    status: int
    message: str
    headers: list[tuple[str, str]] = field(default_factory=list)


async def authenticate(state: GatewayState, authorization: str | None) -> KeyIdentity:
    raw = bearer(authorization)
    if raw is None:
        raise ApiError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            [("WWW-Authenticate", "Bearer")],
        )
    identity = await state.identify(raw)
    if identity is None:
        raise ApiError(401, "invalid or revoked API key", [("WWW-Authenticate", "Bearer")])
    return identity


async def rate_limit(state: GatewayState, identity: KeyIdentity) -> None:
    wait = await state.limiter.acquire(identity.tenant_id, identity.rate, identity.burst)
    if wait is not None:
        raise ApiError(
            429,
            f"rate limit exceeded for tenant {identity.tenant_slug!r} "
            f"({identity.rate:g} requests/s, burst {identity.burst})",
            [("Retry-After", retry_after_header(wait))],
        )


def parse_version(version: str | None) -> int | None:
    if version is None or version == "":
        return None
    if not version.isdigit() or int(version) < 1:
        raise ApiError(400, f"version must be a positive integer, got {version!r}")
    return int(version)


async def resolve(
    state: GatewayState, identity: KeyIdentity, model_name: str, version: str | None
) -> Route:
    try:
        return await state.route(identity.tenant_id, model_name, parse_version(version))
    except RouteMissing as exc:
        raise ApiError(404, str(exc)) from None


async def admit(
    state: GatewayState, authorization: str | None, model_name: str, version: str | None
) -> tuple[KeyIdentity, Route]:
    """Authenticate, rate-limit and resolve: every request goes through this first."""
    identity = await authenticate(state, authorization)
    await rate_limit(state, identity)
    return identity, await resolve(state, identity, model_name, version)


def check_tensor(spec: InputSpec, array: np.ndarray, where: str) -> None:
    """Refuse a tensor the version's signature does not accept."""
    if len(array.shape) != len(spec.shape) or any(
        want not in (-1, got) for want, got in zip(spec.shape, array.shape, strict=True)
    ):
        raise ApiError(
            400,
            f"{where}: shape {list(array.shape)} does not match the signature "
            f"{list(spec.shape)} of input {spec.name!r}",
        )
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ApiError(400, f"{where}: contains NaN or infinity")


def check_complete(route: Route, names: list[str]) -> None:
    missing = [spec.name for spec in route.inputs if spec.name not in names]
    if missing:
        raise ApiError(
            400,
            f"inputs: missing input {missing[0]!r}; the model takes "
            f"{[s.name for s in route.inputs]}",
        )


async def run_inference(
    state: GatewayState,
    route: Route,
    names: list[str],
    arrays: list[np.ndarray],
    outputs: list[str] | None = None,
) -> list[tuple[str, np.ndarray]]:
    """Dispatch to an agent and return (name, array) per output, in the agent's order."""
    try:
        reply, result = await state.pool.infer(
            route.version_id, names, arrays, outputs, state.infer_timeout
        )
    except DispatchError as exc:
        retry = [("Retry-After", str(exc.retry_after))] if exc.retry_after else []
        raise ApiError(exc.status, exc.message, retry) from None
    if isinstance(reply, InferError):
        status = {"bad_input": 400, "overloaded": 503, "not_loaded": 503}.get(reply.code, 500)
        retry = [("Retry-After", "1")] if status == 503 else []
        prefix = "model rejected the input" if status == 400 else f"agent error ({reply.code})"
        raise ApiError(status, f"{prefix}: {reply.message}", retry)
    return [(t.name, a) for t, a in zip(reply.outputs, result, strict=True)]
