"""CPU cost per request of choosing an agent link (``gateway.dispatch.AgentPool._local_link``,
on the gateway's hot path) with spot pools, at 2, 4 and 16 links serving the version: links all
on-demand (the version is not "mixed": one set lookup, no filter), a mix of spot and on-demand
links for an interactive and a batch request (``prefer_spot`` filters), and the same mix with
the filter patched out (the pick as it was before spot pools, the baseline).

    .venv/bin/python bench/spot_pick_cost.py

Prints a Markdown table of ns per pick (best of 7 interleaved runs of 200,000 picks each).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from gateway import dispatch  # noqa: E402
from gateway.dispatch import AgentLink, AgentPool  # noqa: E402
from serving_agent.protocol import BATCH, INTERACTIVE  # noqa: E402

N = 200_000
RUNS = 7


async def _never(message: bytes) -> None:
    raise AssertionError("not sent")


def pool_of(links: int, spot: int) -> AgentPool:
    pool = AgentPool()
    for i in range(links):
        link = AgentLink(f"agent-{i}", _never, spot=i < spot)
        pool.add(link)
        pool.set_ready(link, 1, True)
    return pool


def per_pick_ns(pool: AgentPool, priority: int, prefer: bool = True) -> float:
    pick = pool._local_link
    dispatch.prefer_spot = PREFER if prefer else _as_before
    try:
        start = time.perf_counter_ns()
        for _ in range(N):
            pick(1, [], priority)
        return (time.perf_counter_ns() - start) / N
    finally:
        dispatch.prefer_spot = PREFER


PREFER = dispatch.prefer_spot


def _as_before(links: list[AgentLink], priority: int) -> list[AgentLink]:
    """The pick before spot pools: no filter at all (the baseline)."""
    return links


def main() -> None:
    rows = []
    for links in (2, 4, 16):
        cases = {
            "half spot, no filter (before)": (pool_of(links, links // 2), INTERACTIVE, False),
            "all on-demand": (pool_of(links, 0), INTERACTIVE, True),
            "half spot, interactive": (pool_of(links, links // 2), INTERACTIVE, True),
            "half spot, batch": (pool_of(links, links // 2), BATCH, True),
        }
        best = {name: float("inf") for name in cases}
        for _ in range(RUNS):
            for name, (pool, priority, prefer) in cases.items():
                best[name] = min(best[name], per_pick_ns(pool, priority, prefer))
        rows.append((links, best))
    names = list(rows[0][1])
    print("| links | " + " | ".join(f"{n} (ns)" for n in names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for links, best in rows:
        print(f"| {links} | " + " | ".join(f"{best[n]:.0f}" for n in names) + " |")


if __name__ == "__main__":
    main()
