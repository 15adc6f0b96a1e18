"""Fault drill: a process dies under supervision. The platform runs under supervisord with the
config `make up` uses (deploy/supervisord.conf: web, Celery worker and beat, one agent) plus a
spare agent outside it; four client threads send OIP v2 infer requests throughout; the agent,
the worker and beat are SIGKILLed in turn. Prints one row per kill: the requests started from
the kill until the process did its job again (failed: any non-200; lost: no HTTP answer at
all), the time that took, and the requests of the steady period after it.

The same drill as tests/e2e/test_supervision.py (tests/e2e/supervision_drill.py).
Run: ``.venv/bin/python bench/drill_supervision.py [--backend embedded|services]`` (services:
PostgreSQL and Redis from DATABASE_URL and REDIS_URL).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.harness import drill_heading, run_drill_on  # noqa: E402
from tests.e2e.supervision_drill import CONCURRENCY, run_drill, table  # noqa: E402

DEFAULT = "embedded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["embedded", "services"], default=DEFAULT)
    args = parser.parse_args()
    rows = run_drill_on(args.backend, lambda backend: run_drill(backend, say=_say))
    print(
        drill_heading(
            args.backend, f"{CONCURRENCY} client threads, one agent supervised and one spare"
        )
    )
    print(table(rows))


def _say(line: str) -> None:
    print(f"# {line}", file=sys.stderr)


if __name__ == "__main__":
    main()
