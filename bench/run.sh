#!/usr/bin/env bash
# Run the OIP v2 benchmark (needs wrk, taskset, PostgreSQL and redis-server on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 1; }
exec .venv/bin/python bench/oip_bench.py "$@"
