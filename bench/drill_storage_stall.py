"""Fault drill: the prediction log's storage (S3) stalls for 5 s under load (100 % sampling).

Starts moto's S3 server in a process of its own, a uvicorn server and a serving agent logging
to it (embedded backend, or PostgreSQL + Redis with ``--services``), sends OIP v2 requests from a
few clients and stops the S3 server (SIGSTOP) for the stall, then resumes it (SIGCONT); checks
that every 2xx answer has its row in the Parquet files exactly once (matched by request id) and
prints a Markdown table: what was broken, requests sent, failed, lost and doubled (both must be
0), batches retried, time to recover. The same drill is ``tests/e2e/test_predlog_stall.py``.

Run: ``.venv/bin/python bench/drill_storage_stall.py [--stall-s 5] [--clients 4] [--services]``.
Exits 1 if anything was lost or written twice.
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

from tests.e2e.storage_stall_drill import run_storage_stall_drill  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stall-s", type=float, default=5.0, help="how long S3 is stopped")
    parser.add_argument("--clients", type=int, default=4, help="sequential clients sending")
    parser.add_argument("--before-s", type=float, default=2.0, help="load before the stall")
    parser.add_argument("--after-s", type=float, default=3.0, help="load after the stall")
    parser.add_argument("--services", action="store_true", help="PostgreSQL + Redis backend")
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    if args.services:
        os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
        os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    with tempfile.TemporaryDirectory(prefix="sy-drill-") as tmp:
        result = run_storage_stall_drill(
            Path(tmp),
            backend_name="services" if args.services else "embedded",
            stall_s=args.stall_s,
            before_s=args.before_s,
            after_s=args.after_s,
            clients=args.clients,
        )
    today = datetime.date.today().isoformat()
    backend = "PostgreSQL + Redis" if args.services else "the embedded backend"
    print(
        f"Recorded {today} on {platform.node()} ({os.cpu_count()} CPUs), {backend}, the log on "
        f"moto's S3 server, one uvicorn process and one agent, {args.clients} clients, "
        f"{args.before_s:g} s of load before the stall and {args.after_s:g} s after:\n"
    )
    print(result.table())
    if set(result.statuses) - {200}:
        print(f"\nstatuses: {result.statuses}")
    return 1 if result.lost or result.doubled else 0


if __name__ == "__main__":
    raise SystemExit(main())
