"""Which version answers a request: the active rollout plan of the alias it named picks a
sticky arm from the routing key, and may sample a shadow copy."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from monitoring.traffic import NO_PLAN, PlanArmKey
from tenants.keys import KeyIdentity

from .dispatch import DispatchError
from .errors import ApiError, api_error
from .routes import Route, RouteMissing
from .state import GatewayState


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
