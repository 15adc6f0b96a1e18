"""Shadow copies: a rollout plan's sampled requests sent again to the shadow version once the
reply is sent, compared with the answer and counted per plan, never returned."""

from __future__ import annotations

import logging

import numpy as np

from serving_agent.protocol import SHADOW
from tenants.keys import KeyIdentity

from .arms import Routed
from .dispatch import DispatchError
from .errors import ApiError
from .graphs import run_route
from .routes import RouteMissing
from .scheduling import Schedule
from .state import GatewayState

log = logging.getLogger(__name__)


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
        result = await run_route(
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
