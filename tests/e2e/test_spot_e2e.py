"""Spot pools with real processes: one version deployed on a spot pool and on an on-demand
pool, one agent replica each. Batch-class requests are served by the spot replica and
interactive ones by the other (each agent's own request counter says so); when the spot
replica is killed in the middle of a stream of batch requests, the requests it held answer a
retryable 502 and a client that retries those loses none: its retries land on the replica that
is left."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest

from tests.onnx_models import slow_onnx

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import (
    PY,
    Backend,
    Proc,
    create_node,
    create_tenant,
    free_port,
    start_server,
    wait_until,
)

# Not serial: it asserts outcomes (which replica answered, no request lost), not timings.
pytestmark = pytest.mark.e2e

X = np.ones((1, 4), np.float32)
STREAM = 300  # batch requests in the stream the spot replica dies in
CLIENTS = 3


def body(priority: str) -> dict:
    return {
        "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": X.ravel().tolist()}],
        "parameters": {"priority": priority},
    }


def start_replica(backend: Backend, url: str, token: str, deployment: str, name: str) -> Proc:
    """An agent started as a deployment's replica (what the cluster backend would start)."""
    args = [PY, "-m", "serving_agent", "--platform", url, "--token", token]
    args += ["--deployment", deployment, "--cache-dir", str(backend.var_dir / f"cache-{name}")]
    return Proc(name, args, backend.env, backend.var_dir)


def served(backend: Backend) -> dict[str, int]:
    """Requests each live replica's heartbeat counts, by deployment name."""
    rows = backend.query(
        "SELECT deployment_name, stats FROM gateway_agentsession WHERE disconnected_at IS NULL"
    )
    out = {}
    for name, stats in rows:
        stats = json.loads(stats) if isinstance(stats, str) else (stats or {})
        out[name] = int(stats.get("requests_total", 0))
    return out


def ready_replicas(backend: Backend) -> int:
    rows = backend.query(
        "SELECT ready_versions FROM gateway_agentsession WHERE disconnected_at IS NULL"
    )
    return sum(1 for (ready,) in rows if (json.loads(ready) if isinstance(ready, str) else ready))


# Tenant t and each pool's node.
SEED = (("tenant", "t"), ("node", "node-spot"), ("node", "node-ondemand"))


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_batch_prefers_spot_and_survives_its_pre_emption(backend_name, tmp_path):
    backend = make_backend(backend_name, tmp_path)
    backend.env["SWITCHYARD_AGENT_HEARTBEAT_S"] = "0.5"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(backend, "uvicorn", port)
    agents: list[Proc] = []
    try:
        key = create_tenant(backend, "t")
        pools = [
            {"name": "spot", "backend": "local", "spot": True},
            {"name": "ondemand", "backend": "local"},
        ]
        backend.manage("sync_pools", "--json", json.dumps(pools))
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        upload_and_promote(client, "clf", slow_onnx(depth=8))
        names = {}
        for pool in ("spot", "ondemand"):
            made = client.post(
                "/api/v1/deployments", json={"model": "clf", "version": 1, "pool": pool}
            )
            assert made.status_code == 201, made.text
            names[pool] = made.json()["cluster_name"]
        for pool in ("spot", "ondemand"):
            token = create_node(backend, f"node-{pool}")
            agents.append(start_replica(backend, url, token, names[pool], f"agent-{pool}"))
        spot, ondemand = agents
        wait_ready(client, "clf", 60, spot)
        wait_until(lambda: ready_replicas(backend) == 2, 60, ondemand)
        time.sleep(0.5)  # the second replica's ready state reaches the pool with its status

        def counts() -> tuple[int, int]:
            now = served(backend)
            return now.get(names["spot"], 0), now.get(names["ondemand"], 0)

        def settled(expected: tuple[int, int]) -> bool:
            return counts() == expected

        for _ in range(20):
            response = client.post("/v2/models/clf/infer", json=body("batch"))
            assert response.status_code == 200, response.text
        wait_until(lambda: settled((20, 0)), 10)
        for _ in range(20):
            response = client.post("/v2/models/clf/infer", json=body("interactive"))
            assert response.status_code == 200, response.text
        wait_until(lambda: settled((20, 20)), 10)

        # A stream of batch requests from several clients that retry a 502 or 503 carrying
        # Retry-After; the spot replica is killed a third of the way in.
        answered: list[int] = []
        retried: list[tuple[int, str]] = []
        failed: list[tuple[int, str]] = []
        lock = threading.Lock()
        todo = iter(range(STREAM))

        def stream() -> None:
            with httpx.Client(base_url=url, headers=client.headers, timeout=30) as c:
                while True:
                    with lock:
                        i = next(todo, None)
                    if i is None:
                        return
                    for _ in range(5):
                        response = c.post("/v2/models/clf/infer", json=body("batch"))
                        if response.status_code == 200:
                            with lock:
                                answered.append(i)
                            break
                        retryable = response.status_code in (502, 503)
                        if retryable and response.headers.get("retry-after"):
                            with lock:
                                retried.append((response.status_code, response.text[:200]))
                            time.sleep(0.05)
                            continue
                        with lock:
                            failed.append((response.status_code, response.text[:200]))
                        break

        threads = [threading.Thread(target=stream) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        wait_until(lambda: len(answered) >= STREAM // 3, 30)
        spot.kill()
        for t in threads:
            t.join(60)
        print(f"{backend_name}: {len(answered)} answered, retried {retried}, failed {failed}")
        assert failed == []
        assert sorted(answered) == list(range(STREAM))
        assert all(status in (502, 503) for status, _ in retried)
        # The replica left took the rest of the stream.
        wait_until(lambda: served(backend).get(names["ondemand"], 0) > 20, 10)
    finally:
        for proc in [*agents, server]:
            proc.stop()
        backend.close()
