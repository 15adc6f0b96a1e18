"""A request's schedule: its priority class and its deadline, read from the request (OIP's
``parameters``, OpenAI's ``priority``, the timeout and priority headers) within what its API
key allows. The agent queues by the class and drops a request past its deadline."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from serving_agent.protocol import INTERACTIVE, PRIORITY_CLASSES
from tenants.keys import KeyIdentity

from .errors import ApiError, shown
from .state import GatewayState


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
