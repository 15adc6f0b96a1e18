"""The circuit-breaker drill with real processes: a version that errors on every request, its
breaker, the fallback ladder, and recovery once the fault clears or the version is rolled back.

Run by tests/e2e/test_breaker_drill.py (which asserts what must hold) and by
bench/drill_breaker.py (which prints the table in docs/reliability.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from tests.onnx_models import poisoned_onnx, small_onnx

from .harness import (
    Backend,
    Proc,
    create_node,
    create_tenant,
    free_port,
    start_agent,
    start_server,
    wait_until,
)

POISON = 1000.0  # a value over the poisoned version's threshold: it raises on such rows
COOLDOWN_S = 1.0


@dataclass
class Phase:
    """One step of the drill as a client saw it."""

    name: str
    broken: str
    sent: int = 0
    failed: int = 0  # no usable answer (non-2xx)
    degraded: int = 0  # answered by a lower step of the ladder
    recover_s: float | None = None  # until the version itself answered again
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return self.failed  # a request without an answer is a lost request

    def count(self, response: httpx.Response) -> bool:
        """Record one answer; True when the version asked for answered it itself."""
        self.sent += 1
        self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        if response.status_code != 200:
            self.failed += 1
            return False
        if response.headers.get("x-switchyard-degraded"):
            self.degraded += 1
            return False
        return True


def body(value: float) -> dict:
    return {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4}]}


def upload(client: httpx.Client, artifact: bytes, alias: str | None) -> int:
    files = {"artifact": ("model.onnx", artifact, "application/octet-stream")}
    created = client.post("/api/v1/models/clf/versions", files=files)
    assert created.status_code == 201, created.text
    number = created.json()["version"]
    if alias:
        moved = client.put(f"/api/v1/models/clf/aliases/{alias}", json={"version": number})
        assert moved.status_code == 200, moved.text
    return number


APPROVER = """
from django.contrib.auth import get_user_model
from tenants.models import Membership, Tenant
user = get_user_model().objects.create_user("abe", password="pw-abe-12345")
Membership.objects.create(tenant=Tenant.objects.get(slug="alpha"), user=user, role="approver")
"""

# The rows start_platform needs (make_backend's seed): its node, tenant alpha and approver abe.
BREAKER_SEED = (("node", "n"), ("tenant", "alpha"), ("shell", APPROVER))


def start_platform(backend: Backend) -> tuple[str, str, list[Proc]]:
    """uvicorn and one agent; tenant ``alpha`` with an API key and an approver, ``abe``."""
    backend.env["SWITCHYARD_BREAKER_COOLDOWN_S"] = str(COOLDOWN_S)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [start_server(backend, "uvicorn", port)]
    procs.append(start_agent(backend, url, create_node(backend, "n")))
    key = create_tenant(backend, "alpha")
    backend.shell(APPROVER)
    return url, key, procs


def approve(url: str, request_id: int, comment: str) -> None:
    """Approve a promotion request as the approver would, signed in to the web UI."""
    with httpx.Client(base_url=url, timeout=30) as web:
        web.get("/login/")
        form = {
            "username": "abe",
            "password": "pw-abe-12345",
            "csrfmiddlewaretoken": web.cookies["csrftoken"],
        }
        signed_in = web.post("/login/", data=form, headers={"Referer": f"{url}/login/"})
        assert signed_in.status_code == 302, signed_in.text
        decided = web.post(
            f"/api/v1/approvals/{request_id}/approve",
            json={"comment": comment},
            headers={"X-CSRFToken": web.cookies["csrftoken"], "Referer": f"{url}/"},
        )
        assert decided.status_code == 200, decided.text


def run_drill(url: str, key: str, requests: int = 60) -> list[Phase]:
    """Model ``clf``: v2 (poisoned) promoted to production over v1, v1 (production's
    last-known-good) its fallback, v3 a good version kept warm under ``staging``. Three phases:
    every request poisoned; the fault cleared (plain rows); poisoned again, then production
    moved to v3."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        assert client.post("/api/v1/models", json={"name": "clf", "task": "classifier"}).is_success
        upload(client, small_onnx(seed=2), "production")
        upload(client, poisoned_onnx(), None)
        upload(client, small_onnx(seed=3), "staging")
        shipped = client.put("/api/v1/models/clf/aliases/production", json={"version": 2})
        assert shipped.status_code == 202, shipped.text
        approve(url, shipped.json()["id"], "ship v2")
        # The traffic gate takes only a version approved for production as its fallback.
        changed = client.patch("/api/v1/models/clf", json={"fallback_version": 1})
        assert changed.status_code == 200, changed.text
        for version in (1, 2, 3):
            path = f"/v2/models/clf/versions/{version}/ready"
            wait_until(lambda p=path: client.get(p).status_code == 200, 60)

        def infer(value: float) -> httpx.Response:
            return client.post("/v2/models/clf/infer", json=body(value))

        fault = Phase("version errors on every request", "v2 raises on every row sent")
        for _ in range(requests):
            fault.count(infer(POISON))

        fixed = Phase("fault clears", "none (rows v2 can take)")
        started = time.monotonic()
        for _ in range(requests):
            if fixed.count(infer(0.5)) and fixed.recover_s is None:
                fixed.recover_s = time.monotonic() - started
            if fixed.recover_s is None:
                time.sleep(0.05)  # the breaker waits out its cooldown before a probe

        rollback = Phase("rolled back to v3", "v2 raises; production moved to v3 (approved)")
        for _ in range(10):
            rollback.count(infer(POISON))
        # Production is protected: the rollback is a promotion request an approver approves.
        asked = client.put("/api/v1/models/clf/aliases/production", json={"version": 3})
        assert asked.status_code == 202, asked.text
        approve(url, asked.json()["id"], "roll back: v2 fails every request")
        started = time.monotonic()
        for _ in range(requests):
            if rollback.count(infer(POISON)) and rollback.recover_s is None:
                rollback.recover_s = time.monotonic() - started
            if rollback.recover_s is None:
                time.sleep(0.05)  # gateways see the move at their next refresh
        return [fault, fixed, rollback]


def table(phases: list[Phase]) -> str:
    lines = [
        "| phase | what was broken | requests sent | failed | degraded | lost | time to recover |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in phases:
        recover = "—" if p.recover_s is None else f"{p.recover_s:.2f} s"
        lines.append(
            f"| {p.name} | {p.broken} | {p.sent} | {p.failed} | {p.degraded} | {p.lost} | "
            f"{recover} |"
        )
    return "\n".join(lines)


def degraded_rows(backend: Backend) -> int:
    """Degraded answers the gateway has flushed to its traffic samples (the SLO's input)."""
    rows = backend.query("SELECT COALESCE(SUM(degraded), 0) FROM gateway_trafficsample")
    return int(rows[0][0])
