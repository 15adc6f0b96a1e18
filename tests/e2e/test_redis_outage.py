"""A Redis outage under load, on a platform whose Redis the test owns: predictions never answer
500 while Redis is down (the rate limiter and the stream budgets fall back to each process's own
budgets, the agent's socket does not need Redis), and everything works again within seconds of
Redis coming back."""

from __future__ import annotations

import collections
import threading
import time

import httpx
import pytest

from tests.conftest import OwnRedis
from tests.onnx_models import small_onnx

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import create_node, create_tenant, free_port, start_agent, start_server, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.serial]

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1] * 4}]}
OUTAGE_S = 10
RECOVERY_S = 10


def test_predictions_get_no_500_while_redis_is_down_and_recover_after(tmp_path):
    redis = OwnRedis()
    redis.start()
    backend = make_backend("services", tmp_path)
    backend.env["REDIS_URL"] = redis.url
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [start_server(backend, "uvicorn", port)]
    try:
        procs.append(start_agent(backend, url, create_node(backend, "n")))
        key = create_tenant(backend, "alpha")
        client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        upload_and_promote(client, "clf", small_onnx())
        wait_ready(client, "clf", proc=procs[-1])

        stop = threading.Event()
        outcomes: list[tuple[float, int]] = []  # (when, status)

        def load() -> None:
            with httpx.Client(base_url=url, headers=client.headers, timeout=30) as c:
                while not stop.is_set():
                    try:
                        status = c.post("/v2/models/clf/infer", json=BODY).status_code
                    except httpx.HTTPError:
                        status = 0  # the connection itself failed
                    outcomes.append((time.monotonic(), status))
                    time.sleep(0.01)

        workers = [threading.Thread(target=load) for _ in range(4)]
        for worker in workers:
            worker.start()
        try:
            time.sleep(2)
            redis.stop()
            down_at = time.monotonic()
            time.sleep(OUTAGE_S)
            redis.start()
            up_at = time.monotonic()
            # Recovered: every request of a whole second answered 200, within RECOVERY_S.
            wait_until(lambda: recovered(outcomes, up_at), RECOVERY_S + 5, interval=0.5)
            recovered_s = time.monotonic() - up_at
        finally:
            stop.set()
            for worker in workers:
                worker.join(30)
        during = collections.Counter(s for t, s in outcomes if down_at <= t < up_at)
        print(f"while Redis was down: {dict(during)}; recovered {recovered_s:.1f} s after")
        statuses = collections.Counter(s for _, s in outcomes)
        assert statuses[500] == 0 and statuses[0] == 0, statuses
        assert during[200] > 0, during  # requests kept being served while Redis was down
        assert recovered_s <= RECOVERY_S
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()
        redis.stop()


def recovered(outcomes: list[tuple[float, int]], since: float) -> bool:
    """A full second after ``since`` in which every request was answered 200."""
    now = time.monotonic()
    window = [s for t, s in outcomes if since < t and now - 1.0 <= t]
    return len(window) >= 5 and all(s == 200 for s in window)
