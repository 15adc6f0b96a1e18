"""Auto-rollback with real processes: a slow candidate under a canary is rolled back by the
Celery beat task, traffic returns to the baseline, and the audit log says why."""

from __future__ import annotations

import httpx
import pytest

from .conftest import plan_towards_slow_candidate, platform_with_agent
from .harness import create_tenant, wait_until

pytestmark = pytest.mark.e2e

# 48 rows: the slow candidate takes ~250 ms on them, the baseline ~1 ms, so the p99 ratio is
# far past the threshold even if a baseline request meets a GC pause.
BODY = {"inputs": [{"name": "x", "shape": [48, 4], "datatype": "FP32", "data": [0.1] * 192}]}


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_slow_candidate_is_rolled_back_by_the_beat_task(backend_name, tmp_path):
    env = {"SWITCHYARD_GUARDRAIL_INTERVAL_S": "1"}
    with platform_with_agent(backend_name, tmp_path, env, celery=True) as (backend, url, procs):
        key = create_tenant(backend, "t")
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            plan = plan_towards_slow_candidate(c, mode="canary", weight=50, bake_seconds=600)
            wait_until(lambda: c.get("/v2/models/clf/versions/2/ready").status_code == 200, 60)
            versions = set()
            for i in range(60):  # about 30 per arm, past min_samples (20)
                r = c.post("/v2/models/clf/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
                assert r.status_code == 200, r.text
                versions.add(r.json()["model_version"])
            assert versions == {"1", "2"}

            def state() -> str:
                return c.get(f"/api/v1/rollouts/{plan['id']}").json()["state"]

            try:
                wait_until(lambda: state() == "rolled_back", 60, procs[-1], interval=0.5)
            except TimeoutError:
                detail = c.get(f"/api/v1/rollouts/{plan['id']}").json()
                pytest.fail(f"not rolled back: {detail['state']}, {detail['status_note']}")
            rollback = c.get("/api/v1/audit", params={"action": "plan.rollback"}).json()
            assert rollback[0]["actor_label"] == "guardrails" and "p99" in rollback[0]["reason"]

            def all_on_baseline() -> bool:
                for i in range(30):
                    r = c.post("/v2/models/clf/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
                    if r.status_code != 200 or r.json()["model_version"] != "1":
                        return False
                return True

            wait_until(all_on_baseline, 10)
