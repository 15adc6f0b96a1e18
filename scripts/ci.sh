#!/usr/bin/env bash
# `make ci`: install, the migrations check, then the tests (scripts/test.sh) with the lint beside
# their serial pass. ruff, lint-imports and mypy have no timing to keep, and mypy's ~150 s are
# one core's work: scripts/test.sh runs them at nice 19 beside the serial end-to-end pass, which
# leaves about half of the two cores unused (TEST_BESIDE); their output, time and status come
# after that pass's, and a failing lint fails CI. Each step's time is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
MAKE_=(make --no-print-directory)

t0=$SECONDS
"${MAKE_[@]}" install
echo "-- install: $((SECONDS - t0)) s"
t0=$SECONDS
"${MAKE_[@]}" migrations-check
echo "-- migrations-check: $((SECONDS - t0)) s"

TEST_BESIDE="${MAKE_[*]} lint" "${MAKE_[@]}" test
