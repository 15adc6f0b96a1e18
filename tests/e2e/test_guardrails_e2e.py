"""Guardrails with real processes: a slow candidate under a canary is rolled back by the Celery
beat task, traffic returns to the baseline, and the audit log says why; a healthy one climbs to
100 %, waits for an approver, and is promoted by the beat task once approved."""

from __future__ import annotations

import httpx
import pytest

from tests.onnx_models import small_onnx

from .conftest import plan_towards_slow_candidate, platform_with_agent, upload_and_promote
from .harness import allow_weight, create_tenant, wait_until

pytestmark = pytest.mark.e2e

# 48 rows: the slow candidate takes ~250 ms on them, the baseline ~1 ms, so the p99 ratio is
# far past the threshold even if a baseline request meets a GC pause.
# Tenant t, whose canaries may carry 100 % without approval (this test is about the guardrails).
SEED = (("tenant", "t"), ("weight", "t", 100))
BODY = {"inputs": [{"name": "x", "shape": [48, 4], "datatype": "FP32", "data": [0.1] * 192}]}


# Serial: the rollback needs the candidate's p99 3x the baseline's, and a baseline request slowed
# by a busy neighbour could close that gap. The healthy candidate's bound (50x) holds beside others.
@pytest.mark.serial
@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_slow_candidate_is_rolled_back_by_the_beat_task(backend_name, tmp_path):
    env = {"SWITCHYARD_GUARDRAIL_INTERVAL_S": "1"}
    with platform_with_agent(backend_name, tmp_path, env, celery=True, seed=SEED) as started:
        backend, url, procs = started
        key = create_tenant(backend, "t")
        allow_weight(backend, "t", 100)  # this test is about the guardrails, not approvals
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


APPROVE_PENDING = """
from django.contrib.auth import get_user_model
from rollouts.approvals import approve
from tenants.audit import user_actor
from rollouts.models import ApprovalRequest
from tenants.models import Membership, Role, Tenant
user = get_user_model().objects.create_user("ann")
Membership.objects.create(tenant=Tenant.objects.get(slug="t"), user=user, role=Role.APPROVER)
req = ApprovalRequest.objects.get(state="pending")
print(approve(req, user_actor(user, Role.APPROVER), "numbers look fine").state)
"""


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_healthy_candidate_is_promoted_by_the_beat_task_once_approved(backend_name, tmp_path):
    env = {"SWITCHYARD_GUARDRAIL_INTERVAL_S": "1"}
    with platform_with_agent(backend_name, tmp_path, env, celery=True, seed=SEED) as started:
        backend, url, procs = started
        key = create_tenant(backend, "t")
        allow_weight(backend, "t", 100)  # this test is about the guardrails, not approvals
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            upload_and_promote(c, "clf", small_onnx())
            files = {"artifact": ("v2.onnx", small_onnx(seed=3), "application/octet-stream")}
            assert c.post("/api/v1/models/clf/versions", files=files).status_code == 201
            guardrails = {"max_error_rate_increase": 0.05, "max_p99_ratio": 50, "min_samples": 20}
            # v2 is another random model: its scores differ from v1's on the same traffic, which
            # the drift check would roll back for. This test is about the promotion path.
            guardrails["max_drift_psi"] = None
            body = {"mode": "canary", "candidate": 2, "weight": 50, "steps": [50, 100]}
            body |= {"bake_seconds": 1, "guardrails": guardrails}
            plan = c.post("/api/v1/models/clf/rollouts", json=body).json()
            wait_until(lambda: c.get("/v2/models/clf/versions/2/ready").status_code == 200, 60)

            def detail() -> dict:
                return c.get(f"/api/v1/rollouts/{plan['id']}").json()

            def serve_then(check) -> bool:
                for i in range(40):
                    r = c.post("/v2/models/clf/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
                    assert r.status_code == 200, r.text
                return check()

            # 50 % → 100 % on its own, then it waits: promotion needs an approver.
            waiting = lambda: "waiting for approval" in detail()["status_note"]  # noqa: E731
            try:
                wait_until(lambda: serve_then(waiting), 60, procs[-1], interval=0.5)
            except TimeoutError:
                pytest.fail(f"never asked for approval: {detail()}")
            assert detail()["weight"] == 100 and detail()["state"] == "running"
            pending = c.get("/api/v1/approvals", params={"state": "pending"}).json()
            assert [(p["kind"], p["requested_by"]) for p in pending] == [
                ("promotion", "guardrails")
            ]
            assert backend.shell(APPROVE_PENDING).strip() == "approved"

            wait_until(lambda: detail()["state"] == "promoted", 30, procs[-1], interval=0.5)
            assert c.get("/api/v1/models/clf/aliases/production").json()["version"] == 2
            r = c.post("/v2/models/clf/infer", json=BODY, headers={"X-User-Id": "u1"})
            assert r.json()["model_version"] == "2"
            promote = c.get("/api/v1/audit", params={"action": "plan.promote"}).json()
            assert promote[0]["actor_label"] == "guardrails"
