"""Failure paths with real processes: rate limits, a killed agent, a tampered artifact,
revocation reaching the data path, and an idle agent socket on the Redis channel layer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import httpx
import pytest

from tests.onnx_models import slow_onnx, small_onnx

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import create_node, create_tenant, free_port, start_agent, start_server, wait_until

pytestmark = pytest.mark.e2e


def body(rows: int = 1) -> dict:
    return {
        "inputs": [
            {"name": "x", "shape": [rows, 4], "datatype": "FP32", "data": [0.5] * (rows * 4)}
        ]
    }


@pytest.fixture(params=["embedded", "services"])
def platform(request, tmp_path):
    """A backend and a uvicorn server, without an agent; tests start what they need."""
    backend = make_backend(request.param, tmp_path)
    port = free_port()
    server = start_server(backend, "uvicorn", port)
    started = [server]
    yield backend, f"http://127.0.0.1:{port}", started
    for proc in reversed(started):
        proc.stop()
    backend.close()


def test_burst_past_the_quota_gets_429_with_retry_after_then_refills(platform):
    backend, url, started = platform
    key = create_tenant(backend, "small", rps=2, burst=5)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
        statuses = [client.get("/v2/models/none").status_code for _ in range(12)]
        assert statuses.count(404) >= 5 and 429 in statuses
        refused = client.get("/v2/models/none")
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert "rate limit exceeded" in refused.json()["error"]
        time.sleep(1.6)  # 2 tokens/s: at least 3 back
        assert client.get("/v2/models/none").status_code == 404


def test_agent_killed_mid_request_gives_a_clear_5xx_and_a_restarted_agent_serves(platform):
    backend, url, started = platform
    key = create_tenant(backend, "t")
    token = create_node(backend, "n")
    agent = start_agent(backend, url, token, "agent-1")
    started.append(agent)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        upload_and_promote(client, "slow", slow_onnx(), max_batch_size="1")
        wait_ready(client, "slow", timeout=60, proc=agent)

        def call(_):
            start = time.monotonic()
            with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
                r = c.post("/v2/models/slow/infer", json=body(128))
            return r, time.monotonic() - start

        # max_batch_size 1: the agent runs the 24 requests one after another (tens of ms each),
        # so when the first answer is back most are still queued or running: kill it then.
        with ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(call, i) for i in range(24)]
            next(as_completed(futures))
            agent.kill()
            results = [f.result() for f in futures]
        failed = [(r, t) for r, t in results if r.status_code != 200]
        assert failed, "the agent was killed while requests were in flight"
        for response, took in failed:
            assert response.status_code in (502, 503), response.text
            assert response.json()["error"]
            assert took < 12  # within the deadline (10 s by default), not hanging
        assert client.post("/v2/models/slow/infer", json=body()).status_code == 503
        assert client.get("/v2/models/slow/ready").status_code == 503

        restarted = start_agent(backend, url, token, "agent-2")
        started.append(restarted)
        wait_ready(client, "slow", timeout=60, proc=restarted)
        assert client.post("/v2/models/slow/infer", json=body()).status_code == 200


def test_agent_refuses_a_tampered_artifact(platform):
    backend, url, started = platform
    key = create_tenant(backend, "t")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        version = upload_and_promote(c, "clf", small_onnx())
        stored = next((backend.var_dir / "media" / "artifacts").rglob(f"{version['sha256']}.onnx"))
        stored.write_bytes(small_onnx(seed=1))  # same shape, other weights: a swapped file
        agent = start_agent(backend, url, create_node(backend, "n"))
        started.append(agent)
        wait_until(lambda: "sha256 mismatch" in agent.log(), 30, agent)
        assert c.get("/v2/models/clf/ready").status_code == 503
        assert c.post("/v2/models/clf/infer", json=body()).status_code == 503


def test_revoked_key_stops_working_within_a_second(platform):
    backend, url, started = platform
    key = create_tenant(backend, "t")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
        assert client.get("/v2/models/none").status_code == 404  # key cached by the gateway
        backend.shell(
            "from tenants.models import ApiKey; from tenants.keys import revoke_api_key; "
            "[revoke_api_key(k) for k in ApiKey.objects.all()]"
        )
        revoked_at = time.monotonic()
        wait_until(lambda: client.get("/v2/models/none").status_code == 401, 5)
        assert time.monotonic() - revoked_at < 2.0


def test_idle_agent_socket_survives_on_the_channel_layer(platform):
    """channels-redis 4.3 + redis-py 8 dropped idle consumers after 5 s; not here."""
    backend, url, started = platform
    key = create_tenant(backend, "t")
    agent = start_agent(backend, url, create_node(backend, "n"))
    started.append(agent)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        upload_and_promote(c, "clf", small_onnx())
        wait_ready(c, "clf", proc=agent)
        time.sleep(7)
        assert c.post("/v2/models/clf/infer", json=body()).status_code == 200
    assert "disconnected" not in agent.log()


def test_a_request_past_its_deadline_gets_504(tmp_path):
    backend = make_backend("embedded", tmp_path)
    backend.env["SWITCHYARD_INFER_TIMEOUT_S"] = "0.05"
    port = free_port()
    server = start_server(backend, "uvicorn", port)
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(backend, url, create_node(backend, "n"))
    try:
        key = create_tenant(backend, "t")
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as c:
            upload_and_promote(c, "slow", slow_onnx())
            wait_ready(c, "slow", timeout=60, proc=agent)
            start = time.monotonic()
            response = c.post("/v2/models/slow/infer", json=body(1024))
            assert response.status_code == 504
            assert "did not answer within 0.05 s" in response.json()["error"]
            assert time.monotonic() - start < 2
    finally:
        agent.stop()
        server.stop()
        backend.close()
