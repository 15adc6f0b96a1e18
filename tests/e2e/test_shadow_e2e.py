"""Shadow mode with real processes: the baseline answers at its own speed, copies to a slow
candidate neither delay the client nor spend the tenant's quota, and the comparison is recorded."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.onnx_models import slow_onnx, small_onnx

from .conftest import make_backend, upload_and_promote
from .harness import create_node, create_tenant, free_port, start_agent, start_server, wait_until

pytestmark = pytest.mark.e2e

BODY = {"inputs": [{"name": "x", "shape": [16, 4], "datatype": "FP32", "data": [0.2] * 64}]}


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_shadow_copies_do_not_delay_or_spend_quota_and_are_recorded(backend_name, tmp_path):
    backend = make_backend(backend_name, tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [start_server(backend, "uvicorn", port)]
    try:
        procs.append(start_agent(backend, url, create_node(backend, "n")))
        # 12 requests of burst: the 12 shadow copies would exhaust it if they counted.
        key = create_tenant(backend, "t", rps=0.01, burst=16)
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
                    "mode": "shadow",
                    "candidate": 2,
                    "shadow_sample": 1.0,
                    "guardrails": guardrails,
                },
            ).json()

            # Readiness probes through OIP would spend the tiny quota: ask the node registry.
            def both_ready() -> bool:
                out = backend.shell(
                    "from gateway.models import AgentSession as S;"
                    "print(sorted(v for s in S.objects.filter(disconnected_at=None)"
                    " for v in s.ready_versions))"
                )
                return out.strip() == "[1, 2]"

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
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()
