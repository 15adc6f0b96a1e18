"""Drill: a version that errors on every request, with real processes (uvicorn and a serving
agent) on PostgreSQL + Redis. Its breaker opens, every request is answered by the fallback
version and marked degraded, none fails; once the fault clears (or production is rolled back)
the version answers again by itself. bench/drill_breaker.py prints the same drill as a table."""

from __future__ import annotations

import pytest

from .breaker_drill import degraded_rows, run_drill, start_platform, table
from .conftest import make_backend
from .harness import wait_until

pytestmark = pytest.mark.e2e


def test_a_failing_version_degrades_to_its_fallback_and_recovers(tmp_path):
    backend = make_backend("services", tmp_path)
    url, key, procs = start_platform(backend)
    try:
        fault, fixed, rollback = run_drill(url, key, requests=40)
        print(table([fault, fixed, rollback]))
        # Nothing failed or was lost: every poisoned request got the fallback's answer.
        assert (fault.sent, fault.failed, fault.degraded) == (40, 0, 40), fault
        # The fault cleared: after the cooldown, the probe closed the breaker.
        assert fixed.failed == 0 and fixed.recover_s is not None, fixed
        assert fixed.degraded < fixed.sent
        # Rolled back: production's new version answers by itself, nothing failed meanwhile.
        assert rollback.failed == 0 and rollback.recover_s is not None, rollback
        # The degraded answers reached the traffic samples the SLOs read (flushed every 5 s).
        wait_until(lambda: degraded_rows(backend) >= 40, 15)
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()
