"""Auto-rollback with real processes: a slow candidate under a canary is rolled back by the
Celery beat task, traffic returns to the baseline, and the audit log says why."""

from __future__ import annotations

import httpx
import pytest

from tests.onnx_models import slow_onnx, small_onnx

from .conftest import make_backend, upload_and_promote
from .harness import (
    create_node,
    create_tenant,
    free_port,
    start_agent,
    start_celery,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.e2e

# 16 rows: the slow candidate takes ~80 ms on them, the baseline ~1 ms.
BODY = {"inputs": [{"name": "x", "shape": [16, 4], "datatype": "FP32", "data": [0.1] * 64}]}


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_slow_candidate_is_rolled_back_by_the_beat_task(backend_name, tmp_path):
    backend = make_backend(backend_name, tmp_path)
    backend.env["SWITCHYARD_GUARDRAIL_INTERVAL_S"] = "1"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [start_server(backend, "uvicorn", port)]
    try:
        procs.append(start_agent(backend, url, create_node(backend, "n")))
        procs += [start_celery(backend, "worker"), start_celery(backend, "beat")]
        key = create_tenant(backend, "t")
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as c:
            upload_and_promote(c, "clf", small_onnx())
            files = {"artifact": ("slow.onnx", slow_onnx(depth=96), "application/octet-stream")}
            assert c.post("/api/v1/models/clf/versions", files=files).status_code == 201
            guardrails = {"max_error_rate_increase": 0.05, "max_p99_ratio": 3, "min_samples": 20}
            plan = c.post(
                "/api/v1/models/clf/rollouts",
                json={
                    "mode": "canary",
                    "candidate": 2,
                    "weight": 50,
                    "bake_seconds": 600,
                    "guardrails": guardrails,
                },
            ).json()
            wait_until(lambda: c.get("/v2/models/clf/versions/2/ready").status_code == 200, 60)
            versions = set()
            for i in range(150):
                r = c.post("/v2/models/clf/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
                assert r.status_code == 200, r.text
                versions.add(r.json()["model_version"])
            assert versions == {"1", "2"}

            def state() -> str:
                return c.get(f"/api/v1/rollouts/{plan['id']}").json()["state"]

            wait_until(lambda: state() == "rolled_back", 60, procs[-1], interval=0.5)
            rollback = c.get("/api/v1/audit", params={"action": "plan.rollback"}).json()
            assert rollback[0]["actor_label"] == "guardrails" and "p99" in rollback[0]["reason"]

            def all_on_baseline() -> bool:
                for i in range(30):
                    r = c.post("/v2/models/clf/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
                    if r.status_code != 200 or r.json()["model_version"] != "1":
                        return False
                return True

            wait_until(all_on_baseline, 10)
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()
