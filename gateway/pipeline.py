"""The one pipeline both front doors call: authenticate → rate-limit → resolve → validate →
dispatch. Each step raises ``ApiError`` with the status and a message that names the problem.
"""

from __future__ import annotations

import logging
import math
import re
import reprlib
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from platform_site.tokens import bearer
from serving_agent.protocol import (
    INTERACTIVE,
    OIP_TO_NUMPY,
    PRIORITY_CLASSES,
    SHADOW,
    InferError,
    InferResult,
)
from tenants.keys import KeyIdentity
from tenants.ratelimit import retry_after_header

from .dispatch import RETRY_STATUSES, DispatchError, status_of
from .metrics import Observed
from .routes import InputSpec, Route, RouteMissing
from .state import GatewayState

log = logging.getLogger(__name__)

# Work that runs once the reply is sent (shadow copies).
After = list[Coroutine[Any, Any, None]]


@dataclass
class ApiError(Exception):
    status: int
    message: str
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class ParsedInfer:
    """An inference request as a codec (REST or gRPC) read it: what the pipeline runs."""

    id: str | None
    names: list[str]
    arrays: list[np.ndarray]
    outputs: list[str] | None  # None: all outputs
    binary_outputs: set[str]  # REST only: outputs to send as binary data
    parameters: object = None  # the request's parameters (priority, timeout: see schedule())


# How an error message quotes a value the caller sent: short, and safe at any depth (the repr
# of a list nested 1,000 deep, which a JSON body may hold, raises RecursionError).
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother = 2, 60, 60


def shown(value: object) -> str:
    """``value`` as an error message quotes it (a bounded repr)."""
    return _QUOTE.repr(value)


_ASCII_INT = re.compile(r"[0-9]{1,18}")


def ascii_int(text: str) -> int | None:
    """A non-negative integer written in ASCII digits (as HTTP headers and URLs write them),
    else None. ``str.isdigit`` is no test: it accepts "²", which ``int`` refuses, and a string
    of thousands of digits, which ``int`` refuses too (and would be no length anyway)."""
    return int(text) if _ASCII_INT.fullmatch(text) else None


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
    number = ascii_int(version)
    if number is None or number < 1:
        raise ApiError(400, f"version must be a positive integer, got {shown(version)}")
    return number


async def resolve(
    state: GatewayState, identity: KeyIdentity, model_name: str, version: str | None
) -> Route:
    try:
        return await state.route(identity.tenant_id, model_name, parse_version(version))
    except RouteMissing as exc:
        raise ApiError(404, str(exc)) from None
    except DispatchError as exc:
        raise api_error(exc) from None


def api_error(exc: DispatchError) -> ApiError:
    retry = [("Retry-After", str(exc.retry_after))] if exc.retry_after else []
    return ApiError(exc.status, exc.message, retry)


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


def check_input(
    route: Route, name: str, datatype: object, where: str, seen: list[str]
) -> InputSpec:
    """The signature's spec of one named input tensor, refusing a name given twice, a name the
    model does not take and a datatype other than the model's (both codecs, REST and gRPC)."""
    if name in seen:
        raise ApiError(400, f"{where}.name: input {name!r} given twice")
    spec = route.input(name)
    if spec is None:
        raise ApiError(
            400,
            f"{where}.name: unknown input {name!r}; the model takes "
            f"{[s.name for s in route.inputs]}",
        )
    if not isinstance(datatype, str) or datatype not in OIP_TO_NUMPY:
        raise ApiError(400, f"{where}.datatype: unsupported datatype {shown(datatype)}")
    if datatype != spec.datatype:
        raise ApiError(400, f"{where}.datatype: the model expects {spec.datatype}, got {datatype}")
    return spec


@dataclass(frozen=True, slots=True)
class Schedule:
    """How the agent schedules a request: its priority class (an index of
    ``PRIORITY_CLASSES``, 0 best) and its budget in ms (the gateway waits that long, and the
    agent drops it unrun once that much has passed since it arrived there)."""

    priority: int
    budget_ms: float


TIMEOUT_HEADER = "x-switchyard-timeout-ms"
_HEADER_MS = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,3})?$")


def schedule(
    state: GatewayState,
    identity: KeyIdentity,
    parameters: object = None,
    timeout_header: str | None = None,
) -> Schedule:
    """The schedule a request asks for, within what its key allows. Every front door calls it.

    ``parameters``: the request's parameters object (OIP's request ``parameters``), read for
    ``priority`` (a class name, or Triton's integers: 1 best .. 4, 0 the key's default) and
    ``timeout`` (microseconds, as Triton). ``timeout_header``: the value of the
    ``x-switchyard-timeout-ms`` header, if sent. Without either, the key's priority and the
    server's timeout; a timeout is capped at the server's. A value that cannot be read is a 400;
    a priority above the key's (its ceiling) a 403.
    """
    params = parameters if parameters is not None else {}
    if not isinstance(params, dict):
        raise ApiError(400, "parameters: must be an object")
    priority = _priority(params.get("priority"), identity.priority)
    if priority < identity.priority:
        raise ApiError(
            403,
            f"parameters.priority: {PRIORITY_CLASSES[priority]!r} is above what this API key "
            f"may ask for ({PRIORITY_CLASSES[identity.priority]!r})",
        )
    budget_ms = state.infer_timeout * 1000
    timeout_us = params.get("timeout")
    if timeout_us is not None:
        if (
            isinstance(timeout_us, bool)
            or not isinstance(timeout_us, int | float)
            or not math.isfinite(timeout_us)
            or timeout_us <= 0
        ):
            raise ApiError(
                400,
                f"parameters.timeout: must be a positive number of microseconds, got "
                f"{shown(timeout_us)}",
            )
        budget_ms = min(budget_ms, timeout_us / 1000)
    if timeout_header is not None:
        value = timeout_header.strip()
        if not _HEADER_MS.match(value) or float(value) <= 0:
            raise ApiError(
                400,
                f"{TIMEOUT_HEADER}: must be a positive number of milliseconds, got "
                f"{timeout_header[:40]!r}",
            )
        budget_ms = min(budget_ms, float(value))
    return Schedule(priority, budget_ms)


def _priority(asked: object, default: int) -> int:
    if asked is None:
        return default
    if isinstance(asked, str) and asked in PRIORITY_CLASSES:
        return PRIORITY_CLASSES.index(asked)
    if isinstance(asked, int) and not isinstance(asked, bool) and 0 <= asked <= 4:
        return default if asked == 0 else asked - 1
    raise ApiError(
        400,
        f"parameters.priority: must be one of {', '.join(PRIORITY_CLASSES)}, or an integer "
        f"0-4 (1 best, 0 the key's default); got {shown(asked)}",
    )


def default_schedule(state: GatewayState, identity: KeyIdentity | None = None) -> Schedule:
    """The key's priority (interactive without a key) and the server's timeout."""
    priority = identity.priority if identity is not None else INTERACTIVE
    return Schedule(priority, state.infer_timeout * 1000)


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
    if route.generates_text:
        raise ApiError(
            400,
            f"model {route.model_name!r} generates text: use the websocket "
            f"/ws/v1/models/{route.model_name}/generate or POST /v1/completions",
        )
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
    observed: Observed | None = None,
    *,
    identity: KeyIdentity | None = None,
    sched: Schedule | None = None,
) -> list[tuple[str, np.ndarray]]:
    """Dispatch to an agent and return (name, array) per output, in the agent's order.

    The caller (``identity``'s tenant and key) and ``sched`` (see ``schedule``; the key's
    class and the server's timeout without one) go on the frame: the agent queues the request
    by class, shares the version fairly between callers, and drops it past its budget.
    Every outcome is counted per version (for guardrails): a 5xx is an error, a 4xx is not.
    """
    if sched is None:
        sched = default_schedule(state, identity)
    started = time.perf_counter()
    if observed is not None:
        observed.route = route
        observed.names, observed.arrays = names, arrays
    try:
        await state.ready(route.version_id)  # holds a cold start; at once when warm
        reply, result = await state.pool.infer(
            route.version_id,
            names,
            arrays,
            outputs,
            sched.budget_ms / 1000,
            observed.trace.traceparent if observed is not None else "",
            tenant=identity.tenant_id if identity is not None else 0,
            key=identity.key_id if identity is not None else 0,
            priority=sched.priority,
        )
    except DispatchError as exc:
        if observed is not None:
            observed.mark("dispatch")
        state.traffic.record(route.version_id, time.perf_counter() - started, exc.status < 500)
        raise api_error(exc) from None
    ok = not isinstance(reply, InferError) or status_of(reply) < 500
    state.traffic.record(route.version_id, time.perf_counter() - started, ok)
    if observed is not None:
        observed.mark("dispatch")
        if isinstance(reply, InferResult):
            observed.agent_times(reply.queue_ms, reply.compute_ms)
    if isinstance(reply, InferError):
        status = status_of(reply)
        retry = [("Retry-After", "1")] if status in RETRY_STATUSES else []
        prefix = "model rejected the input" if status == 400 else f"agent error ({reply.code})"
        raise ApiError(status, f"{prefix}: {reply.message}", retry)
    answer = [(t.name, a) for t, a in zip(reply.outputs, result, strict=True)]
    if observed is not None:
        observed.outputs = answer
    return answer


@dataclass
class Routed:
    """Which version answers a request, and where (if anywhere) a shadow copy goes."""

    route: Route
    arm: str | None = None
    plan_id: int | None = None
    shadow_version_id: int | None = None


async def route_request(
    state: GatewayState,
    identity: KeyIdentity,
    route: Route,
    explicit_version: bool,
    header: Callable[[str], str | None],
    request_id: str | None,
) -> Routed:
    """Apply the model's active rollout plan, if any: a sticky arm from the routing key (the
    plan's header, else the request id, else random) and the sampled shadow copy."""
    if explicit_version:
        return Routed(route)
    try:
        split = await state.split(identity.tenant_id, route.model_name)
    except DispatchError as exc:
        raise api_error(exc) from None
    if split is None:
        return Routed(route)
    key = header(split.routing_header) or request_id or uuid.uuid4().hex
    arm = split.choose(key)
    if arm.version_id != route.version_id:
        try:
            route = await state.version_route(identity.tenant_id, arm.version_id)
        except RouteMissing as exc:
            raise ApiError(404, str(exc)) from None
        except DispatchError as exc:
            raise api_error(exc) from None
    return Routed(route, arm.name, split.plan_id, split.shadow_for(key))


async def predict(
    state: GatewayState,
    identity: KeyIdentity,
    route: Route,
    explicit_version: bool,
    header: Callable[[str], str | None],
    parsed: ParsedInfer,
    observed: Observed,
    after: After,
    sched: Schedule,
) -> tuple[Routed, list[tuple[str, np.ndarray]]]:
    """An admitted, parsed prediction: choose the arm, run it as ``sched`` says (see
    ``schedule``), and queue the shadow copy (if the plan samples one) on ``after``, to run
    once the reply is sent."""
    routed = await route_request(state, identity, route, explicit_version, header, parsed.id)
    observed.arm = routed.arm
    observed.mark("routing")
    answer = await run_inference(
        state,
        routed.route,
        parsed.names,
        parsed.arrays,
        parsed.outputs,
        observed,
        identity=identity,
        sched=sched,
    )
    if routed.shadow_version_id is not None:
        after.append(shadow_copy(state, identity, routed, parsed.names, parsed.arrays, answer))
    return routed, answer


async def shadow_copy(
    state: GatewayState,
    identity: KeyIdentity,
    routed: Routed,
    names: list[str],
    arrays: list[np.ndarray],
    answer: list[tuple[str, np.ndarray]],
) -> None:
    """Run the shadow version on the same input after the reply; compare, never return.

    Not rate-limited: shadows never count against the tenant's quota. It travels in the
    ``shadow`` class, which agents serve last and shed first.
    """
    # Only a rollout plan sends shadow copies, and route_request sets both from it.
    assert routed.shadow_version_id is not None and routed.plan_id is not None
    try:
        route = await state.version_route(identity.tenant_id, routed.shadow_version_id)
        sched = Schedule(SHADOW, state.infer_timeout * 1000)
        result = await run_inference(state, route, names, arrays, identity=identity, sched=sched)
    except (ApiError, RouteMissing, DispatchError) as exc:
        log.info("shadow copy to version %s failed: %s", routed.shadow_version_id, exc)
        answered, agreed, failed = 0, 0, 1
    else:
        answered, agreed, failed = 1, int(_agree(answer[0][1], result[0][1])), 0
    # Looked up only now, with no await before the update: the refresh loop swaps the dict
    # out when it flushes, and counts added to a flushed one would be lost.
    stats = state.shadow_stats.setdefault(routed.plan_id, [0, 0, 0])
    stats[0] += answered
    stats[1] += agreed
    stats[2] += failed


def _agree(baseline: np.ndarray, shadow: np.ndarray) -> bool:
    """Same class for 2-D scores (classifiers), else numerically close."""
    if baseline.shape != shadow.shape:
        return False
    if baseline.ndim == 2 and baseline.shape[1] > 1:
        return bool((baseline.argmax(1) == shadow.argmax(1)).all())
    return bool(np.allclose(baseline, shadow, rtol=1e-3, atol=1e-5))
