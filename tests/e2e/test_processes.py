"""Celery worker and beat against each backend; two gateway processes sharing one agent through
the Redis channel layer; a stock Triton client against the OIP v2 endpoints."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.onnx_models import small_onnx

from .conftest import make_backend, upload_and_promote, wait_ready
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


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_celery_worker_runs_tasks_and_beat_loads_the_schedule(backend_name, tmp_path):
    backend = make_backend(backend_name, tmp_path)
    worker = start_celery(backend, "worker")
    beat = start_celery(backend, "beat")
    try:
        # A session whose gateway died without closing it: the housekeeping task closes it.
        backend.shell(
            "from datetime import timedelta; from django.utils import timezone;"
            "from fleet.models import AgentSession, Node;"
            "n = Node.objects.create(name='ghost', token_prefix='x', token_hash='x');"
            "s = AgentSession.objects.create(node=n, channel_name='gone');"
            "AgentSession.objects.filter(pk=s.pk).update("
            "last_heartbeat_at=timezone.now() - timedelta(minutes=5))"
        )
        backend.shell("from fleet.tasks import mark_stale_agents_offline as t; t.delay()")

        def closed() -> bool:  # a direct read: manage.py shell costs seconds per poll
            ((at,),) = backend.query(
                "SELECT disconnected_at FROM gateway_agentsession WHERE channel_name = ?",
                ("gone",),
            )
            return at is not None

        wait_until(closed, 60, worker, interval=1.0)
        wait_until(
            lambda: backend.query(
                "SELECT 1 FROM django_celery_beat_periodictask WHERE task = ?",
                ("fleet.tasks.mark_stale_agents_offline",),
            ),
            30,
            beat,
        )
    finally:
        beat.stop()
        worker.stop()
        backend.close()


def test_two_gateway_processes_share_an_agent_through_redis(tmp_path):
    """uvicorn with two workers: the agent's socket lands in one process; requests reaching the
    other travel through the Redis channel layer and still get answers."""
    backend = make_backend("services", tmp_path)
    port = free_port()
    server = start_server(backend, "uvicorn", port, "--workers", "2")
    url = f"http://127.0.0.1:{port}"
    agent = None
    try:
        key = create_tenant(backend, "t")
        agent = start_agent(backend, url, create_node(backend, "n"))
        x = np.random.default_rng(3).normal(size=(1, 4)).astype(np.float32)
        body = {
            "inputs": [
                {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x.ravel().tolist()}
            ]
        }
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            upload_and_promote(client, "clf", small_onnx())
            wait_ready(client, "clf", proc=agent)
            # The other process learns of the agent on its next refresh (0.5 s): wait until
            # ten fresh connections in a row, spread over both workers, find the model ready.
            wait_until(lambda: all(_ready_on_fresh_connection(url, headers) for _ in range(10)), 10)
            # New connections spread over both workers; every one must be answered.
            statuses = []
            for _ in range(40):
                with httpx.Client(base_url=url, headers=headers, timeout=30) as fresh:
                    response = fresh.post("/v2/models/clf/infer", json=body)
                    statuses.append((response.status_code, response.text[:200]))
        assert [s for s, _ in statuses] == [200] * 40, (statuses, server.log()[-4000:])
    finally:
        if agent is not None:
            agent.stop()
        server.stop()
        backend.close()


def _ready_on_fresh_connection(url: str, headers: dict) -> bool:
    with httpx.Client(base_url=url, headers=headers, timeout=10) as fresh:
        return fresh.get("/v2/models/clf/ready").status_code == 200


def test_a_stock_triton_client_works_unchanged(tmp_path):
    import onnxruntime as ort
    import tritonclient.http as triton

    backend = make_backend("embedded", tmp_path)
    port = free_port()
    server = start_server(backend, "uvicorn", port)
    agent = None
    try:
        key = create_tenant(backend, "t")
        url = f"http://127.0.0.1:{port}"
        agent = start_agent(backend, url, create_node(backend, "n"))
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as c:
            upload_and_promote(c, "clf", small_onnx())
            wait_ready(c, "clf", proc=agent)
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        headers = {"Authorization": f"Bearer {key}"}
        assert client.is_server_live() and client.is_model_ready("clf", headers=headers)
        x = np.random.default_rng(4).normal(size=(3, 4)).astype(np.float32)
        for binary in (True, False):
            tensor = triton.InferInput("x", [3, 4], "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            wanted = triton.InferRequestedOutput("y", binary_data=binary)
            # A fresh dict each call: tritonclient writes its binary header into the one given.
            result = client.infer("clf", [tensor], outputs=[wanted], headers=dict(headers))
            ref = ort.InferenceSession(small_onnx(), providers=["CPUExecutionProvider"])
            np.testing.assert_allclose(
                result.as_numpy("y"), ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6
            )
        metadata = client.get_model_metadata("clf", headers=headers)
        assert metadata["inputs"][0]["name"] == "x"
    finally:
        if agent is not None:
            agent.stop()
        server.stop()
        backend.close()
