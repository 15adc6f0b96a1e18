#!/usr/bin/env bash
# The test suite, each test run once where the backend does not matter:
#  1. unit and API tests on PostgreSQL + Redis (DATABASE_URL / REDIS_URL, or the local servers
#     on 127.0.0.1), on two workers;
#  2. the end-to-end tests, which start real processes and run every platform they start on
#     both backends: the embedded default (SQLite, no Redis) and PostgreSQL + Redis; on two
#     workers, except those marked serial (timing-sensitive), which run alone afterwards;
#  3. on the embedded default again, the tests marked `backends`: those where the database's
#     or Redis's own behaviour matters (see the README).
# Without reachable PostgreSQL/Redis everything runs once, on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
WORKERS="${TEST_WORKERS:-2}"
embedded() { (unset DATABASE_URL REDIS_URL; SWITCHYARD_VAR_DIR="$(mktemp -d)" && export SWITCHYARD_VAR_DIR && "$@"); }
# pytest exits 5 when a pass selects no test (e.g. `make test ARGS=tests/test_keys.py` has no
# end-to-end test): that pass has nothing to say.
pytest() { "$PY" -m pytest "$@" || { rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }

if $PY scripts/services_up.py; then
  echo "== unit and API tests: PostgreSQL + Redis ($DATABASE_URL $REDIS_URL)"
  pytest -m "not e2e" -n "$WORKERS" "$@"
  echo "== end-to-end tests: real processes on the embedded default and on PostgreSQL + Redis"
  # Two workers, a module's tests on one (its platform is started once per module); then the
  # timing-sensitive ones (marked serial) alone.
  pytest -m "e2e and not serial" -n "$WORKERS" --dist loadfile --durations=12 "$@"
  pytest -m "e2e and serial" --durations=12 "$@"
  echo "== where the backend matters, again on the embedded default (SQLite, in-process layers)"
  embedded pytest -m "backends and not e2e" -n "$WORKERS" "$@"
else
  echo "== PostgreSQL/Redis not reachable: everything on the embedded default"
  embedded pytest -m "not e2e" -n "$WORKERS" "$@"
  embedded pytest -m "e2e and not serial" -n "$WORKERS" --dist loadfile "$@"
  embedded pytest -m "e2e and serial" "$@"
fi
