"""Two gateway processes and two agents on PostgreSQL + Redis: every agent keeps a data link to
each process, so every request is answered in the process that received it (counted by each
process's ``switchyard_gateway_dispatched_total``); killing an agent, and restarting the
gateway process that holds the other agent's main connection, cost only the requests in
flight on the part that died."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from tests.onnx_models import small_onnx

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import (
    Backend,
    create_node,
    create_tenant,
    dispatched,
    free_port,
    start_agent,
    start_server,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.serial]

THREADS_PER_GATEWAY = 2
RECOVERY_S = 20  # the agent's reconnect backoff (up to 8 s by then) plus the process's start


def body(x: np.ndarray) -> dict:
    return {
        "inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


def served_by_each_agent(backend: Backend) -> list[int]:
    rows = backend.query(
        "SELECT stats FROM gateway_agentsession WHERE disconnected_at IS NULL ORDER BY id"
    )
    return [int((stats or {}).get("requests_total", 0)) for (stats,) in rows]


def test_every_request_is_answered_in_process_and_a_dead_part_costs_only_its_own(tmp_path):
    backend = make_backend("services", tmp_path)
    backend.env["SWITCHYARD_AGENT_HEARTBEAT_S"] = "1"
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    gateways = [start_server(backend, "uvicorn", port) for port in ports]
    agents = []
    try:
        key = create_tenant(backend, "t")
        headers = {"Authorization": f"Bearer {key}"}
        # Each agent's main connection lands on a different process.
        agents = [
            start_agent(backend, urls[i], create_node(backend, f"n{i}"), name=f"agent-{i}")
            for i in range(2)
        ]
        with httpx.Client(base_url=urls[0], headers=headers, timeout=30) as client:
            upload_and_promote(client, "clf", small_onnx())
        clients = [httpx.Client(base_url=u, headers=headers, timeout=30) for u in urls]
        for c in clients:
            wait_ready(c, "clf", proc=agents[0])
        wait_until(lambda: len(both_ready(backend)) == 2, 30, agents[1])

        # Links come up within a refresh of the gateways' registry (5 s): then a probe of
        # requests on both processes is answered without a single forward.
        def probe_in_process() -> bool:
            before = [dispatched(u) for u in urls]
            for c in clients:
                for _ in range(10):
                    response = c.post("/v2/models/clf/infer", json=body(np.ones((1, 4), "f4")))
                    assert response.status_code == 200, response.text
            after = [dispatched(u) for u in urls]
            return all(a["forwarded"] == b["forwarded"] for a, b in zip(after, before, strict=True))

        wait_until(probe_in_process, 30, interval=0.5)

        ref = ort.InferenceSession(small_onnx(), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(7)
        before = [dispatched(u) for u in urls]
        for i in range(200):
            x = rng.normal(size=(2, 4)).astype(np.float32)
            response = clients[i % 2].post("/v2/models/clf/infer", json=body(x))
            assert response.status_code == 200, response.text
            (out,) = [o for o in response.json()["outputs"] if o["name"] == "y"]
            got = np.asarray(out["data"], np.float32).reshape(out["shape"])
            np.testing.assert_allclose(got, ref.run(["y"], {"x": x})[0], rtol=1e-5, atol=1e-6)
        after = [dispatched(u) for u in urls]
        for b, a in zip(before, after, strict=True):
            assert a["forwarded"] - b["forwarded"] == 0
            assert a["local"] - b["local"] == 100
        # Both agents took a share (each process picks the link with fewer requests waiting).
        wait_until(lambda: all(n > 0 for n in served_by_each_agent(backend)), 10)

        # Faults under load: kill agent 1, then restart gateway 0, which holds agent 0's main
        # connection (agent 0 keeps serving gateway 1 over its data link meanwhile).
        outcomes: list[list[tuple[float, int]]] = [[], []]
        bodies: dict[int, str] = {}  # one answer per failing status, for the assertion's message
        stop = threading.Event()

        def load(g: int) -> None:
            with httpx.Client(base_url=urls[g], headers=headers, timeout=30) as c:
                while not stop.is_set():
                    try:
                        status = c.post("/v2/models/clf/infer", json=body(np.ones((1, 4), "f4")))
                        code = status.status_code
                        if code != 200:
                            bodies.setdefault(code, status.text[:300])
                    except httpx.HTTPError:
                        code = 0  # the process is down
                    outcomes[g].append((time.monotonic(), code))
                    time.sleep(0.005)

        threads = [
            threading.Thread(target=load, args=(g,))
            for g in (0, 1)
            for _ in range(THREADS_PER_GATEWAY)
        ]
        for t in threads:
            t.start()
        try:
            time.sleep(1.5)
            agents[1].kill()
            killed_at = time.monotonic()
            time.sleep(3)
            down_at = time.monotonic()
            gateways[0].stop()
            gateways[0] = start_server(backend, "uvicorn", ports[0])
            up_at = time.monotonic()
            wait_until(lambda: all_ok_since(outcomes[0], time.monotonic() - 1), RECOVERY_S)
            recovered_s = time.monotonic() - up_at
            time.sleep(1)
        finally:
            stop.set()
            for t in threads:
                t.join(30)

        failed = [[(t, s) for t, s in out if s != 200] for out in outcomes]
        print(
            f"gateway 1 (up throughout): {len(outcomes[1])} requests, {len(failed[1])} failed; "
            f"gateway 0: down {up_at - down_at:.1f} s, answering again {recovered_s:.1f} s "
            f"after its restart; failures {summary(failed[0])} {bodies}; "
            f"{[(round(t - down_at, 2), s) for t, s in failed[0] if s not in (0, 503)]}"
        )
        # The process that stayed up lost at most the requests in flight on the dead agent.
        assert len(failed[1]) <= THREADS_PER_GATEWAY, failed[1]
        assert all(t - killed_at < 1 for t, _ in failed[1]), failed[1]
        # The restarted one: those in flight on the dead agent, then only while it was down or
        # not yet reached by an agent (503: no agent ready), never a 500 nor a 502: requests in
        # flight when it stops get a retryable 503, its agents being alive.
        at_kill = [(t, s) for t, s in failed[0] if t < down_at]
        assert len(at_kill) <= THREADS_PER_GATEWAY and all(t - killed_at < 1 for t, _ in at_kill)
        after_down = [s for t, s in failed[0] if t >= down_at]
        assert all(s in (0, 503) for s in after_down), (summary(failed[0]), bodies)
        assert recovered_s <= RECOVERY_S
    finally:
        for proc in [*agents, *gateways]:
            proc.stop()
        backend.close()


def both_ready(backend: Backend) -> list[tuple]:
    return backend.query(
        "SELECT id FROM gateway_agentsession WHERE disconnected_at IS NULL "
        "AND ready_versions::text <> '[]'"
    )


def all_ok_since(outcomes: list[tuple[float, int]], since: float) -> bool:
    window = [s for t, s in outcomes if t >= since]
    return len(window) >= 5 and all(s == 200 for s in window)


def summary(failed: list[tuple[float, int]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for _, status in failed:
        counts[status] = counts.get(status, 0) + 1
    return counts
