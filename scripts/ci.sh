#!/usr/bin/env bash
# `make ci`: install, the migrations check, then the tests (scripts/test.sh) with the lint beside
# their end-to-end passes. ruff, lint-imports and mypy have no timing to keep, and mypy's ~150 s
# are one core's work: scripts/test.sh runs them in the idle scheduling class beside the
# end-to-end passes, which leave CPU unused (TEST_BESIDE); their output, time and status come
# after the serial pass's, and a failing lint fails CI. Each step's time is printed.
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
