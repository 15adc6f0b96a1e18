"""Placing versions on multi-model agents by memory: bin packing against each agent's budget.

A pure function over what the agents reported, so it is tested on its own and every gateway
process computes the same answer from the same rows. It places the versions served by nodes
run by hand (the autoscaler's replicas each serve their own deployment's version):

1. Every version gets one copy first, largest first (first-fit decreasing), on the agent that
   already holds it if it still fits there (no reload), else on the agent with the most free
   memory (spreading the load).
2. Then, while memory lasts, more copies go on the other agents, for capacity and failover.

An agent that evicted a version to make room is not given it again: it measured that the
version does not fit beside what it serves. A version that fits nowhere is left unplaced (and
shown as such) rather than overcommitting an agent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """One live agent that placement may fill."""

    key: int  # its session id
    budget_bytes: int  # 0: it did not say; treated as unbounded
    holds: frozenset[int] = frozenset()  # versions it has loaded now
    evicted: frozenset[int] = frozenset()
    scope: int | None = None  # the only tenant whose versions it may serve (None: any)


@dataclass(frozen=True)
class Item:
    version_id: int
    need_bytes: int
    tenant_id: int


@dataclass
class Placement:
    assigned: dict[int, list[int]] = field(default_factory=dict)  # agent key -> version ids
    unplaced: list[int] = field(default_factory=list)


def place(items: Iterable[Item], agents: Iterable[Candidate]) -> Placement:
    agents = sorted(agents, key=lambda a: a.key)
    free = {a.key: (a.budget_bytes or float("inf")) for a in agents}
    result = Placement(assigned={a.key: [] for a in agents})
    ordered = sorted(items, key=lambda i: (-i.need_bytes, i.version_id))

    def eligible(item: Item) -> list[Candidate]:
        return [
            a
            for a in agents
            if (a.scope is None or a.scope == item.tenant_id)
            and item.version_id not in a.evicted
            and item.version_id not in result.assigned[a.key]
            and free[a.key] >= item.need_bytes
        ]

    def put(agent: Candidate, item: Item) -> None:
        result.assigned[agent.key].append(item.version_id)
        free[agent.key] -= item.need_bytes

    for item in ordered:
        fits = eligible(item)
        if not fits:
            result.unplaced.append(item.version_id)
            continue
        holding = [a for a in fits if item.version_id in a.holds]
        put(holding[0] if holding else max(fits, key=lambda a: (free[a.key], -a.key)), item)
    for item in ordered:
        if item.version_id in result.unplaced:
            continue
        for agent in eligible(item):
            put(agent, item)
    for versions in result.assigned.values():
        versions.sort()
    return result
