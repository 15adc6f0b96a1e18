"""Re-runnable drill: a version that errors on every request, its circuit breaker and the
model's fallback ladder, then recovery when the fault clears and when production is rolled
back. Starts its own platform (uvicorn + one agent) on PostgreSQL + Redis when DATABASE_URL
and REDIS_URL are set, else on the embedded default, and prints the table recorded in
docs/reliability.md.

    .venv/bin/python bench/drill_breaker.py [--requests 60]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.breaker_drill import degraded_rows, run_drill, start_platform, table  # noqa: E402
from tests.e2e.harness import (  # noqa: E402
    embedded_backend,
    services_available,
    services_backend,
    wait_until,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="drill-breaker-"))
    backend = services_backend(tmp) if services_available() else embedded_backend(tmp)
    url, key, procs = start_platform(backend)
    try:
        phases = run_drill(url, key, args.requests)
        total = sum(p.degraded for p in phases)
        # The gateway flushes its traffic counts every 5 s.
        wait_until(lambda: degraded_rows(backend) >= total, 15)
        flushed = degraded_rows(backend)
        print(f"backend: {backend.name}; cooldown 1 s; breaker opens after 5 failures\n")
        print(table(phases))
        print(f"\ndegraded answers in the traffic samples (the SLOs' input): {flushed}")
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()


if __name__ == "__main__":
    main()
