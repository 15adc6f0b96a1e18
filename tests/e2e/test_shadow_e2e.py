"""Shadow mode with real processes: the baseline answers at its own speed, copies to a slow
candidate neither delay the client nor spend the tenant's quota, and the comparison is recorded."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .conftest import plan_towards_slow_candidate, platform_with_agent
from .harness import create_tenant, wait_until

pytestmark = pytest.mark.e2e

BODY = {"inputs": [{"name": "x", "shape": [16, 4], "datatype": "FP32", "data": [0.2] * 64}]}


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_shadow_copies_do_not_delay_or_spend_quota_and_are_recorded(backend_name, tmp_path):
    with platform_with_agent(backend_name, tmp_path, seed=(("tenant", "t", 0.01, 16),)) as (
        backend,
        url,
        procs,
    ):
        # 12 requests of burst: the 12 shadow copies would exhaust it if they counted.
        key = create_tenant(backend, "t", rps=0.01, burst=16)
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            plan = plan_towards_slow_candidate(c, mode="shadow", shadow_sample=1.0)

            # Readiness probes through OIP would spend the tiny quota: ask the node registry.
            def both_ready() -> bool:  # a direct read: manage.py shell costs seconds per poll
                rows = backend.query(
                    "SELECT ready_versions FROM gateway_agentsession WHERE disconnected_at IS NULL"
                )
                ready = [json.loads(r) if isinstance(r, str) else r for (r,) in rows]
                return sorted(v for versions in ready for v in versions) == [1, 2]

            wait_until(both_ready, 60, procs[1], interval=0.5)
            took = []
            for i in range(12):
                start = time.perf_counter()
                r = c.post("/v2/models/clf/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
                took.append(time.perf_counter() - start)
                assert r.status_code == 200, r.text
                assert r.json()["model_version"] == "1"  # the baseline answers
            # The slow candidate takes ~80 ms on this input; the client never waits for it.
            assert sorted(took)[len(took) // 2] < 0.04

            def shadow() -> dict:
                return c.get(f"/api/v1/rollouts/{plan['id']}").json()["shadow"]

            wait_until(lambda: shadow()["answered"] + shadow()["failed"] == 12, 30, procs[0], 0.5)
            assert shadow()["failed"] == 0, shadow()
            assert shadow()["agreement_rate"] is not None
