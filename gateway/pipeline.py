"""The prediction every tensor front door (OIP REST and gRPC, the prediction API, embeddings)
runs once a request is admitted and parsed: within its key's in-flight limit, the rollout
plan's arm, the dispatch (or, for a graph version, its nodes' run: ``gateway.graphs``), and the
model's fallback ladder when the version fails; the shadow copy is queued to run after the
reply."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from tenants.keys import KeyIdentity

from .admission import in_flight
from .arms import Routed, route_request
from .checks import check_tensor
from .dispatch import DispatchError
from .errors import ApiError
from .graphs import run_route
from .metrics import Observed
from .parsed import After, ParsedInfer
from .routes import Route, RouteMissing
from .scheduling import Schedule
from .shadow import shadow_copy
from .state import GatewayState

log = logging.getLogger(__name__)


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
    prediction API, embeddings) calls it."""
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
    answer = await run_route(
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
        answer = await run_route(
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
                answer = await run_route(
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
