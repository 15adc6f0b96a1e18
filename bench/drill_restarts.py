"""Fault drill: the web tier restarted, and one of its two workers stopped (SIGTERM) and killed
(SIGKILL), under load, with `make up`'s supervision (deploy/supervisord.conf). Prints one row
per fault: the requests sent from the fault until every client got 200s again plus the steady
period after, split into 200s, other answers (503 with Retry-After), refused connections and
lost requests (accepted, or sent on a kept-alive connection, and closed without an answer); and
the prediction-log rows written against the 200s.

The same drill as tests/e2e/test_restart_drill.py (tests/e2e/restart_drill.py).
Run: ``.venv/bin/python bench/drill_restarts.py [--backend embedded|services]`` (services:
PostgreSQL and Redis from DATABASE_URL and REDIS_URL).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.harness import drill_heading, run_drill_on  # noqa: E402
from tests.e2e.restart_drill import CONCURRENCY, run_drill, table  # noqa: E402

DEFAULT = "services"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["embedded", "services"], default=DEFAULT)
    args = parser.parse_args()
    result = run_drill_on(args.backend, lambda backend: run_drill(backend, say=_say))
    print(drill_heading(args.backend, f"{CONCURRENCY} client threads, two web workers"))
    print(table(result))


def _say(line: str) -> None:
    print(f"# {line}", file=sys.stderr)


if __name__ == "__main__":
    main()
