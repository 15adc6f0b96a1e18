#!/usr/bin/env bash
# `make ci`: install, the migrations check, then the tests (scripts/test.sh) with the lint beside
# them. ruff, lint-imports and mypy have no timing to keep, and mypy's ~2 minutes are one core's
# work: they run in the idle scheduling class (chrt --idle), which gets only the CPU the tests
# leave unused, so they cost no wall time and cannot slow a test, even one with a latency bound
# (the serial end-to-end pass leaves about half of the two cores idle). The lint's output and
# status come after the tests'; either failing fails CI. Each step's time is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
MAKE_=(make --no-print-directory)

t0=$SECONDS
"${MAKE_[@]}" install
echo "-- install: $((SECONDS - t0)) s"
t0=$SECONDS
"${MAKE_[@]}" migrations-check
echo "-- migrations-check: $((SECONDS - t0)) s"

idle=(chrt --idle 0)
"${idle[@]}" true 2>/dev/null || idle=(nice -n 19)
lint_log=$(mktemp)
(
  t0=$SECONDS
  status=0
  "${idle[@]}" "${MAKE_[@]}" lint >"$lint_log" 2>&1 || status=$?
  echo "-- lint (beside the tests, ${idle[*]}): $((SECONDS - t0)) s" >>"$lint_log"
  exit "$status"
) &
lint_pid=$!

tests=0
"${MAKE_[@]}" test || tests=$?
lint=0
wait "$lint_pid" || lint=$?
echo "== lint: ruff, ruff format --check, lint-imports, mypy"
cat "$lint_log"
rm -f "$lint_log"
if [ "$lint" -ne 0 ]; then echo "== lint failed ($lint)"; fi
if [ "$tests" -ne 0 ]; then echo "== tests failed ($tests)"; fi
[ "$tests" -eq 0 ] && [ "$lint" -eq 0 ]
