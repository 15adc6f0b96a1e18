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
import datetime
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.harness import embedded_backend, services_available, services_backend  # noqa: E402
from tests.e2e.restart_drill import CONCURRENCY, run_drill, table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["embedded", "services"], default="services")
    args = parser.parse_args()
    if args.backend == "services" and not services_available():
        parser.error("--backend services needs DATABASE_URL (PostgreSQL) and REDIS_URL")
    tmp = Path(tempfile.mkdtemp(prefix="sy-drill-"))
    make = services_backend if args.backend == "services" else embedded_backend
    backend = make(tmp)
    try:
        result = run_drill(backend, say=lambda line: print(f"# {line}", file=sys.stderr))
    finally:
        backend.close()
        shutil.rmtree(tmp, ignore_errors=True)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"Backend {args.backend}, {when}, {platform.node()} ({os.cpu_count()} CPUs), "
        f"{CONCURRENCY} client threads, two web workers:\n"
    )
    print(table(result))


if __name__ == "__main__":
    main()
