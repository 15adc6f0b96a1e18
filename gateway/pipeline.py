"""The one pipeline both front doors call: authenticate → rate-limit → resolve → validate →
dispatch. Each step raises ``ApiError`` with the status and a message that names the problem.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import reprlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from monitoring.traffic import NO_PLAN, PlanArmKey
from platform_site.errors import Conflict, Invalid, Unprocessable
from platform_site.tokens import bearer
from registry.models import ALIAS_NAME
from serving_agent.protocol import (
    INTERACTIVE,
    OIP_TO_NUMPY,
    PRIORITY_CLASSES,
    SHADOW,
    InferError,
    InferResult,
)
from tenants.keys import KeyIdentity
from tenants.models import Scope
from tenants.ratelimit import retry_after_header

from . import bytes_tensors, idempotency
from .breakers import Breaker
from .dispatch import RETRY_STATUSES, DispatchError, in_background, status_of
from .metrics import Observed
from .routes import DEFAULT_ALIAS, InputSpec, Route, RouteMissing
from .state import GatewayState

log = logging.getLogger(__name__)

PREDICT = Scope.PREDICT.value  # every front door serves inference: the scope each call needs
# A budget stop lasts until an approver's override or the next month: retrying soon is futile.
BUDGET_RETRY_AFTER_S = 3600

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
    # Both from the cached identity: no database query on a warm request.
    if identity.expired():
        raise ApiError(401, "the API key has expired", [("WWW-Authenticate", "Bearer")])
    if PREDICT not in identity.scopes:
        raise ApiError(403, f"this API key lacks the '{PREDICT}' scope")
    return identity


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


@asynccontextmanager
async def unanswered_releases(claim: idempotency.Claim | None) -> AsyncIterator[None]:
    """Around the computation of a request holding an Idempotency-Key ``claim``: when it ends
    without an answer (an error, or the task cancelled) the key is released, so a retry
    computes. Every front door answers through this one rule."""
    if claim is None:
        yield
        return
    try:
        yield
    except asyncio.CancelledError:
        in_background(claim.release())  # a task being cancelled cannot await the release
        raise
    except BaseException:
        await claim.release()
        raise


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
    priority_field: str = "parameters.priority",
) -> Schedule:
    """The schedule a request asks for, within what its key allows. Every front door calls it.

    ``parameters``: the request's parameters object (OIP's request ``parameters``), read for
    ``priority`` (a class name, or Triton's integers: 1 best .. 4, 0 the key's default) and
    ``timeout`` (microseconds, as Triton). ``timeout_header``: the value of the
    ``x-switchyard-timeout-ms`` header, if sent. Without either, the key's priority and the
    server's timeout; a timeout is capped at the server's. A value that cannot be read is a 400;
    a priority above the key's (its ceiling) a 403. Errors about the priority name
    ``priority_field``, where the caller put it.
    """
    params = parameters if parameters is not None else {}
    if not isinstance(params, dict):
        raise ApiError(400, "parameters: must be an object")
    priority = _priority(params.get("priority"), identity.priority, priority_field)
    if priority < identity.priority:
        raise ApiError(
            403,
            f"{priority_field}: {PRIORITY_CLASSES[priority]!r} is above what this API key "
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


def _priority(asked: object, default: int, where: str = "parameters.priority") -> int:
    if asked is None:
        return default
    if isinstance(asked, str) and asked in PRIORITY_CLASSES:
        return PRIORITY_CLASSES.index(asked)
    if isinstance(asked, int) and not isinstance(asked, bool) and 0 <= asked <= 4:
        return default if asked == 0 else asked - 1
    raise ApiError(
        400,
        f"{where}: must be one of {', '.join(PRIORITY_CLASSES)}, or an integer "
        f"0-4 (1 best, 0 the key's default); got {shown(asked)}",
    )


PRIORITY_HEADER = "x-switchyard-priority"


def generation_schedule(
    state: GatewayState,
    identity: KeyIdentity,
    priority: object = None,
    priority_header: str | None = None,
    timeout_header: str | None = None,
) -> Schedule:
    """The schedule of a text generation (OpenAI's API, the generation socket): its class from
    the request's ``priority`` field (as OIP's parameter: a class name, or 1 best .. 4, 0 the
    key's default) or the ``x-switchyard-priority`` header (a class name); both may be sent
    if they agree. Its budget, from the timeout header, bounds its wait for a slot on the agent
    (its first token). Otherwise as ``schedule``: the key's class by default, a 403 above it.
    """
    field_name = "priority"
    if priority_header is not None:
        named = priority_header.strip()
        if named not in PRIORITY_CLASSES:
            raise ApiError(
                400,
                f"{PRIORITY_HEADER}: must be one of {', '.join(PRIORITY_CLASSES)}, got "
                f"{priority_header[:40]!r}",
            )
        if priority is None:
            priority, field_name = named, PRIORITY_HEADER
        elif _priority(priority, identity.priority, "priority") != PRIORITY_CLASSES.index(named):
            raise ApiError(
                400,
                f"priority: {shown(priority)} disagrees with the {PRIORITY_HEADER} header "
                f"({named!r}); send one",
            )
    params = None if priority is None else {"priority": priority}
    return schedule(state, identity, params, timeout_header, priority_field=field_name)


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
        if not spec.allow_missing:
            raise ApiError(
                400,
                f"{where}: contains NaN or infinity (this version does not allow missing "
                "values: upload it with allow_missing=true to take NaN as one)",
            )
        if np.isinf(array).any():
            raise ApiError(400, f"{where}: contains infinity (only NaN marks a missing value)")
    if spec.datatype == "BYTES":
        try:
            bytes_tensors.check(array, spec.text)
        except bytes_tensors.BytesError as exc:
            raise ApiError(400, f"{where}: {exc}") from None


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
    counted: PlanArmKey | None = NO_PLAN,
) -> list[tuple[str, np.ndarray]]:
    """Dispatch to an agent and return (name, array) per output, in the agent's order.

    The caller (``identity``'s tenant and key) and ``sched`` (see ``schedule``; the key's
    class and the server's timeout without one) go on the frame: the agent queues the request
    by class, shares the version fairly between callers, and drops it past its budget.
    Every outcome is counted per version and ``counted`` (the plan and arm that routed it) for
    guardrails and SLOs: a 5xx is an error, a 4xx is not. ``counted=None`` counts nothing
    (shadow copies: they are no user's traffic and have their own ``ShadowSample`` rows).
    """
    if identity is not None and counted is not None:  # a shadow copy is no new work
        check_budget(state, identity)
    if sched is None:
        sched = default_schedule(state, identity)
    started = time.perf_counter()
    if observed is not None:
        observed.route = route
        observed.names, observed.arrays = names, arrays
    breaker = state.version_breakers.get(route.version_id)  # one exists once it failed
    if breaker is not None:
        now = time.monotonic()
        if not breaker.available(now):
            raise ApiError(
                503,
                f"version {route.version} of model {route.model_name!r} is failing; its "
                "circuit breaker is open",
                [("Retry-After", str(breaker.retry_after(now)))],
            )
        breaker.begin(now)
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
        if counted is not None:
            state.traffic.record(
                route.version_id, time.perf_counter() - started, exc.status < 500, counted
            )
        _version_outcome(state, route, exc.status, sched)
        raise api_error(exc) from None
    status = 200 if isinstance(reply, InferResult) else status_of(reply)
    if counted is not None:
        # Usage counts the rows answered: the batch dimension the signature check bounded.
        rows = len(arrays[0]) if status == 200 and arrays and arrays[0].ndim else 0
        state.traffic.record(
            route.version_id, time.perf_counter() - started, status < 500, counted, rows
        )
    _version_outcome(state, route, status, sched)
    if observed is not None:
        observed.mark("dispatch")
        if isinstance(reply, InferResult):
            observed.agent_times(reply.queue_ms, reply.compute_ms)
    if isinstance(reply, InferError):
        retry = [("Retry-After", "1")] if status in RETRY_STATUSES else []
        prefix = "model rejected the input" if status == 400 else f"agent error ({reply.code})"
        raise ApiError(status, f"{prefix}: {reply.message}", retry)
    answer = [(t.name, a) for t, a in zip(reply.outputs, result, strict=True)]
    if observed is not None:
        observed.outputs = answer
    return answer


def _version_outcome(state: GatewayState, route: Route, status: int, sched: Schedule) -> None:
    """Tell the version's breaker how a request went: the version's own failures (an agent
    error, no answer within the server's whole budget) count against it; an answer, a refused
    input, a client's own short deadline or shed load do not, nor does an agent gone (502: its
    link's breaker and the pool deal with that, and a restarted agent must serve at once). A
    breaker is made on the first failure, so a healthy version costs one dict lookup."""
    failed = status == 500 or (
        status == 504 and sched.budget_ms >= state.infer_timeout * 1000 * 0.99
    )
    breaker = state.version_breakers.get(route.version_id)
    if breaker is None:
        if not failed:
            return
        breaker = state.version_breakers[route.version_id] = Breaker(
            state.pool.breaker_failures, state.pool.breaker_cooldown_s
        )
    if failed:
        breaker.failure(time.monotonic())
    elif status < 500:
        breaker.success()


@dataclass
class Routed:
    """Which version answers a request, and where (if anywhere) a shadow copy goes."""

    route: Route
    arm: str | None = None
    plan_id: int | None = None
    shadow_version_id: int | None = None
    # Set when the fallback ladder answered: "fallback" (another version) or "default".
    degraded: str | None = None

    @property
    def counted(self) -> PlanArmKey:
        """Whom the version's traffic counters credit: the plan and arm that routed it."""
        return NO_PLAN if self.plan_id is None else (self.plan_id, self.arm or "")


async def route_request(
    state: GatewayState,
    identity: KeyIdentity,
    route: Route,
    header: Callable[[str], str | None],
    request_id: str | None,
) -> Routed:
    """Apply the active rollout plan of the alias the request named, if any: a sticky arm from
    the routing key (the plan's header, else the request id, else random) and the sampled
    shadow copy. A request that named a version number is answered by that version."""
    if route.alias is None:
        return Routed(route)
    try:
        split = await state.split(identity.tenant_id, route.model_name, route.alias)
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


async def predict(
    state: GatewayState,
    identity: KeyIdentity,
    route: Route,
    header: Callable[[str], str | None],
    parsed: ParsedInfer,
    observed: Observed,
    after: After,
    sched: Schedule,
) -> tuple[Routed, list[tuple[str, np.ndarray]]]:
    """An admitted, parsed prediction, within its key's in-flight limit: choose the arm, run it
    as ``sched`` says (see ``schedule``), and queue the shadow copy (if the plan samples one) on
    ``after``, to run once the reply is sent. Every tensor front door (OIP REST and gRPC, the
    prediction API) calls it."""
    with in_flight(state, identity):
        return await _predict(state, identity, route, header, parsed, observed, after, sched)


async def _predict(
    state: GatewayState,
    identity: KeyIdentity,
    route: Route,
    header: Callable[[str], str | None],
    parsed: ParsedInfer,
    observed: Observed,
    after: After,
    sched: Schedule,
) -> tuple[Routed, list[tuple[str, np.ndarray]]]:
    routed = await route_request(state, identity, route, header, parsed.id)
    observed.arm = routed.arm
    observed.mark("routing")
    if routed.route.degrades:
        return await _down_the_ladder(state, identity, routed, parsed, observed, after, sched)
    answer = await run_inference(
        state,
        routed.route,
        parsed.names,
        parsed.arrays,
        parsed.outputs,
        observed,
        identity=identity,
        sched=sched,
        counted=routed.counted,
    )
    if routed.shadow_version_id is not None:
        after.append(shadow_copy(state, identity, routed, parsed.names, parsed.arrays, answer))
    return routed, answer


# Failures a lower step of the ladder may answer: the server's, never the client's (a bad
# input, its rate limit or share, a client that left).
DEGRADABLE = (500, 502, 503, 504)


async def _down_the_ladder(
    state: GatewayState,
    identity: KeyIdentity,
    routed: Routed,
    parsed: ParsedInfer,
    observed: Observed,
    after: After,
    sched: Schedule,
) -> tuple[Routed, list[tuple[str, np.ndarray]]]:
    """``predict`` for a model with a fallback ladder: the version asked for (within the
    model's primary timeout), then its fallback version (within the fallback timeout), then
    the default answer. Each step has what is left of the request's deadline at most. A lower
    step answering is counted as degraded (its own SLI), not as a failed request."""
    route = routed.route
    deadline = time.monotonic() + sched.budget_ms / 1000
    first = _step_schedule(sched, route.primary_timeout_ms, deadline)
    try:
        answer = await run_inference(
            state,
            route,
            parsed.names,
            parsed.arrays,
            parsed.outputs,
            observed,
            identity=identity,
            sched=first,
            counted=routed.counted,
        )
    except ApiError as exc:
        if exc.status not in DEGRADABLE:
            raise
        failure = exc
    else:
        if routed.shadow_version_id is not None:
            after.append(shadow_copy(state, identity, routed, parsed.names, parsed.arrays, answer))
        return routed, answer
    if route.fallback_version_id is not None:
        fallback = await _fallback_route(state, identity, route, parsed)
        left_ms = (deadline - time.monotonic()) * 1000
        if fallback is not None and left_ms >= 1:
            try:
                answer = await run_inference(
                    state,
                    fallback,
                    parsed.names,
                    parsed.arrays,
                    parsed.outputs,
                    observed,
                    identity=identity,
                    sched=_step_schedule(sched, route.fallback_timeout_ms, deadline),
                )
            except ApiError as exc:
                if exc.status not in DEGRADABLE:
                    raise
                failure = exc
            else:
                return _degraded(state, observed, routed, fallback, "fallback", failure), answer
    default = _default_answer(route, parsed.outputs)
    if default is None:
        raise failure
    observed.outputs = default
    return _degraded(state, observed, routed, route, "default", failure), default


def _step_schedule(sched: Schedule, step_ms: int | None, deadline: float) -> Schedule:
    left_ms = max((deadline - time.monotonic()) * 1000, 1.0)
    budget = left_ms if step_ms is None else min(left_ms, step_ms)
    return Schedule(sched.priority, budget)


async def _fallback_route(
    state: GatewayState, identity: KeyIdentity, route: Route, parsed: ParsedInfer
) -> Route | None:
    """The fallback version's route, if the request fits its signature (else the ladder
    skips it: a fallback with other inputs cannot answer this request)."""
    assert route.fallback_version_id is not None
    try:
        fallback = await state.version_route(identity.tenant_id, route.fallback_version_id)
    except (RouteMissing, DispatchError):
        return None
    for name, array in zip(parsed.names, parsed.arrays, strict=True):
        spec = fallback.input(name)
        if spec is None or spec.dtype != array.dtype:
            return None
        try:
            check_tensor(spec, array, name)
        except ApiError:
            return None
    if parsed.outputs is not None and not set(parsed.outputs) <= set(fallback.output_names):
        return None
    return fallback


def _default_answer(route: Route, outputs: list[str] | None) -> list[tuple[str, np.ndarray]] | None:
    if not route.default_outputs:
        return None
    if outputs is None:
        return list(route.default_outputs)
    chosen = dict(route.default_outputs)
    if not set(outputs) <= set(chosen):
        return None  # the default answer does not hold an output the client asked for
    return [(name, chosen[name]) for name in outputs]


def _degraded(
    state: GatewayState,
    observed: Observed,
    routed: Routed,
    answered_by: Route,
    step: str,
    failure: ApiError,
) -> Routed:
    """The routing of a degraded answer; the failed version's request counts as degraded."""
    state.traffic.degrade(routed.route.version_id, routed.counted)
    state.metrics.degraded(observed.tenant or "", routed.route, step)
    log.info(
        "model %s v%d failed (%d: %s); answered by the %s",
        routed.route.model_name,
        routed.route.version,
        failure.status,
        failure.message,
        step if step == "default" else f"fallback v{answered_by.version}",
    )
    return Routed(answered_by, routed.arm, routed.plan_id, None, step)


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
        result = await run_inference(
            state, route, names, arrays, identity=identity, sched=sched, counted=None
        )
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
    if baseline.dtype.kind == "O" or shadow.dtype.kind == "O":  # BYTES (labels): equal
        return bool((baseline == shadow).all())
    if baseline.ndim == 2 and baseline.shape[1] > 1:
        return bool((baseline.argmax(1) == shadow.argmax(1)).all())
    return bool(np.allclose(baseline, shadow, rtol=1e-3, atol=1e-5))
