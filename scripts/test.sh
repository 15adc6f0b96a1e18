#!/usr/bin/env bash
# Run the test suite twice over:
#  1. against PostgreSQL + Redis (DATABASE_URL / REDIS_URL, or the local servers on 127.0.0.1),
#     everything including the end-to-end tests, which start real processes on both backends;
#  2. on the embedded default (SQLite, no Redis), the unit and API tests.
# Without reachable PostgreSQL/Redis, only the embedded pass runs, with every test in it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"

if $PY scripts/services_up.py; then
  echo "== PostgreSQL + Redis: $DATABASE_URL $REDIS_URL"
  $PY -m pytest "$@"
  echo "== embedded default (SQLite, in-process layers)"
  env -u DATABASE_URL -u REDIS_URL SWITCHYARD_VAR_DIR="$(mktemp -d)" $PY -m pytest -m "not e2e" "$@"
else
  echo "== PostgreSQL/Redis not reachable: embedded default only"
  env -u DATABASE_URL -u REDIS_URL SWITCHYARD_VAR_DIR="$(mktemp -d)" $PY -m pytest "$@"
fi
