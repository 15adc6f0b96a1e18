#!/usr/bin/env bash
# Run the OIP v2 benchmark (needs wrk, taskset, PostgreSQL and redis-server on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python bench/oip_bench.py "$@"
