"""``Idempotency-Key`` with real processes (uvicorn, one serving agent; the embedded default, and
PostgreSQL + Redis): a retried upload makes one version (httpx picks a new multipart boundary
for the retry), a retried alias move writes one audit event, and two identical infers with one
key are computed once by the agent (its own counter of rows run, from its heartbeats)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.onnx_models import small_onnx

from .conftest import platform_with_agent, wait_ready
from .harness import Backend, create_tenant, wait_until
from .test_fair_scheduling import agent_counters

pytestmark = pytest.mark.e2e

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.3] * 4}]}


def count(backend: Backend, table: str, **filters: str) -> int:
    where = " AND ".join(f"{column} = ?" for column in filters)
    sql = f"SELECT COUNT(*) FROM {table}" + (f" WHERE {where}" if where else "")
    ((n,),) = backend.query(sql, tuple(filters.values()))
    return int(n)


def rows_run(backend: Backend) -> int:
    return agent_counters(backend)["batch_rows_total"]


def settle(backend: Backend, expected: int) -> int:
    """The agent's rows run once it reported ``expected``, and two heartbeats more (so a
    second computation would have shown)."""
    wait_until(lambda: rows_run(backend) >= expected, 15)
    time.sleep(1.2)
    return rows_run(backend)


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_retries_with_one_key_act_once(backend_name, tmp_path):
    env = {"SWITCHYARD_AGENT_HEARTBEAT_S": "0.5"}
    with platform_with_agent(backend_name, tmp_path, env, seed=(("tenant", "t"),)) as (
        backend,
        url,
        procs,
    ):
        key = create_tenant(backend, "t")
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
            created = client.post("/api/v1/models", json={"name": "clf", "task": "classifier"})
            assert created.status_code == 201, created.text
            files = {"artifact": ("model.onnx", small_onnx(), "application/octet-stream")}
            uploads = [
                client.post(
                    "/api/v1/models/clf/versions",
                    files=files,
                    headers={"Idempotency-Key": "upload-1"},
                )
                for _ in range(2)
            ]
            assert [u.status_code for u in uploads] == [201, 201], uploads[0].text
            assert uploads[1].json() == uploads[0].json()
            assert uploads[1].headers["Idempotent-Replayed"] == "true"
            assert count(backend, "registry_modelversion") == 1

            moves = [
                client.put(
                    "/api/v1/models/clf/aliases/production",
                    json={"version": 1},
                    headers={"Idempotency-Key": "move-1"},
                )
                for _ in range(2)
            ]
            assert [m.status_code for m in moves] == [200, 200]
            assert count(backend, "rollouts_auditevent", action="alias.move") == 1

            wait_ready(client, "clf", proc=procs[1])
            # The agent's counter moves by one for one computed request...
            before = rows_run(backend)
            assert client.post("/v2/models/clf/infer", json=BODY).status_code == 200
            once = settle(backend, before + 1)
            assert once == before + 1
            # ...and by one for two requests with one key: the retry is the first answer.
            headers = {"Idempotency-Key": "infer-1"}
            first, retry = (
                client.post("/v2/models/clf/infer", json=BODY, headers=headers) for _ in range(2)
            )
            assert first.status_code == retry.status_code == 200
            assert retry.json() == first.json()
            assert retry.headers["Idempotent-Replayed"] == "true"
            assert "Idempotent-Replayed" not in first.headers
            assert settle(backend, once + 1) == once + 1
            # The same key with another body is refused before the agent.
            other = {"inputs": [{**BODY["inputs"][0], "data": [0.9] * 4}]}
            reused = client.post("/v2/models/clf/infer", json=other, headers=headers)
            assert reused.status_code == 422, reused.text
            assert settle(backend, once + 1) == once + 1
