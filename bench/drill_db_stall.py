"""Fault drill: PostgreSQL stalls the prediction log for 5 s under load (100 % log sampling).

Starts a uvicorn server and a serving agent on a fresh PostgreSQL database (and Redis
database) of their own, sends OIP v2 requests from a few clients, and from another connection
holds an ACCESS EXCLUSIVE lock on the prediction log's table for the stall; then checks that
every 2xx answer has its log row (matched by request id) and prints a Markdown table: what was
broken, requests sent, failed, degraded, lost (must be 0), time to recover. The same drill is
the test ``tests/e2e/test_predlog_stall.py``.

Run: ``.venv/bin/python bench/drill_db_stall.py [--stall-s 5] [--clients 4]`` with
``DATABASE_URL`` (an admin URL of the server) and ``REDIS_URL`` set, else the local defaults.
Exits 1 if anything was lost.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")

from tests.e2e.db_stall_drill import run_stall_drill  # noqa: E402
from tests.e2e.harness import services_backend  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stall-s", type=float, default=5.0, help="how long the lock is held")
    parser.add_argument("--clients", type=int, default=4, help="sequential clients sending")
    parser.add_argument("--before-s", type=float, default=2.0, help="load before the stall")
    parser.add_argument("--after-s", type=float, default=3.0, help="load after the stall")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    with tempfile.TemporaryDirectory(prefix="sy-drill-") as tmp:
        backend = services_backend(Path(tmp))
        try:
            result = run_stall_drill(
                backend,
                stall_s=args.stall_s,
                before_s=args.before_s,
                after_s=args.after_s,
                clients=args.clients,
            )
        finally:
            backend.close()
    today = datetime.date.today().isoformat()
    print(
        f"Recorded {today} on {platform.node()} ({os.cpu_count()} CPUs), PostgreSQL + Redis, "
        f"one uvicorn process and one agent, {args.clients} clients, "
        f"{args.before_s:g} s of load before the stall and {args.after_s:g} s after:\n"
    )
    print(result.table())
    if set(result.statuses) - {200}:
        print(f"\nstatuses: {result.statuses}")
    return 1 if result.lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
