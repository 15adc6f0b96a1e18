"""One dispatch of an inference to an agent, with what every dispatch owes: the tenant's
budget stop, the version's circuit breaker, a cold start's hold, the traffic counts that
guardrails and SLOs read, and the agent's error as an ``ApiError``."""

from __future__ import annotations

import time

import numpy as np

from monitoring.traffic import NO_PLAN, PlanArmKey
from serving_agent.protocol import InferError, InferResult
from tenants.keys import KeyIdentity

from .admission import check_budget
from .breakers import Breaker
from .dispatch import RETRY_STATUSES, DispatchError, NotReady, status_of
from .errors import ApiError, api_error
from .metrics import Observed
from .routes import Route
from .scheduling import Schedule, default_schedule
from .state import GatewayState


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
        # Holds a cold start; at once when warm.
        await state.ready(
            route.version_id, route=route, tenant=identity.tenant_slug if identity else ""
        )
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
            max_rows=route.max_batch_size,
        )
    except DispatchError as exc:
        if observed is not None:
            observed.mark("dispatch")
        if counted is not None and isinstance(exc, NotReady):
            # Not the version failing: nothing of it ran yet. Its own count, out of the SLIs.
            state.traffic.not_ready(route.version_id, counted)
        elif counted is not None:
            state.traffic.record(
                route.version_id, time.perf_counter() - started, exc.status < 500, counted
            )
        if not exc.transport:
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
