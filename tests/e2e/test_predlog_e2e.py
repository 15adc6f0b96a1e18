"""The prediction log end to end: a real uvicorn server and agent log real requests under the
request ids their clients got back to Parquet files, feedback joins them, and a locked database
costs neither the requests nor the log anything (the log is not in the database)."""

from __future__ import annotations

import re
import sqlite3
import time

import httpx
import numpy as np
import pytest

from tests.onnx_models import small_onnx

from .conftest import platform_with_agent, upload_and_promote, wait_ready
from .harness import create_tenant, metrics_auth, wait_until

pytestmark = pytest.mark.e2e

# A small buffer, so a stalled writer fills it within a few hundred requests.
ENV = {
    "SWITCHYARD_PREDLOG_BUFFER": "50",
    "SWITCHYARD_PREDLOG_BATCH": "10",
    "SWITCHYARD_PREDLOG_FLUSH_S": "0.2",
    # No heartbeat write during the lock test: on SQLite the agent's consumer would wait on it
    # (20 s busy timeout) with results queued behind it — a stall of the embedded backend, not
    # of the prediction log.
    "SWITCHYARD_AGENT_HEARTBEAT_S": "120",
    "SWITCHYARD_AGENT_STALE_S": "600",
}


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    """The embedded backend (SQLite) with model ``clf`` of tenant alpha logging every request;
    yields (backend, url, alpha's key, beta's key)."""
    tmp = tmp_path_factory.mktemp("predlog")
    with platform_with_agent(
        "embedded", tmp, ENV, seed=(("tenant", "alpha"), ("tenant", "beta"))
    ) as started:
        backend, url, procs = started
        key_a, key_b = create_tenant(backend, "alpha"), create_tenant(backend, "beta")
        with httpx.Client(base_url=url, headers=auth(key_a), timeout=30) as client:
            created = client.post("/api/v1/models", json={"name": "clf", "task": "classifier"})
            assert created.status_code == 201, created.text
            # save(), not update(): the change signal tells the gateway to drop its route cache.
            backend.shell(
                "from registry.models import Model\n"
                "m = Model.objects.get(name='clf')\n"
                "m.log_sample_rate = 1.0\n"
                "m.save()"
            )
            upload_and_promote(client, "clf", small_onnx())
            wait_ready(client, "clf", proc=procs[1])
        yield backend, url, key_a, key_b


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def oip(x: np.ndarray, **headers: str) -> dict:
    return {
        "json": {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        },
        "headers": headers,
    }


def logged(client: httpx.Client, request_id: str) -> list[dict]:
    response = client.get("/api/v1/models/clf/predictions", params={"request_id": request_id})
    assert response.status_code == 200, response.text
    return response.json()["results"]


def dropped(url: str) -> float:
    """The records the prediction log dropped, for any reason."""
    text = httpx.get(f"{url}/metrics", headers=metrics_auth(), timeout=30).text
    found = re.findall(
        r'^switchyard_prediction_log_records_total\{outcome="dropped_\w+"\} (\S+)$', text, re.M
    )
    return sum(map(float, found))


def test_real_requests_are_logged_under_the_ids_clients_got_and_feedback_joins(platform, rng):
    backend, url, key_a, key_b = platform
    sent: dict[str, np.ndarray] = {}
    outputs: dict[str, list] = {}
    with httpx.Client(base_url=url, headers=auth(key_a), timeout=30) as client:
        for i in range(4):
            x = rng.normal(size=(2, 4)).astype(np.float32)
            headers = {"x-request-id": f"client-id-{i}"} if i % 2 else {}
            response = client.post("/v2/models/clf/infer", **oip(x, **headers))
            assert response.status_code == 200, response.text
            request_id = response.headers["x-request-id"]
            assert request_id == headers.get("x-request-id", request_id)
            sent[request_id] = x
            outputs[request_id] = np.reshape(response.json()["outputs"][0]["data"], (2, 2))
        x = rng.normal(size=(3, 4)).astype(np.float32)
        response = client.post("/api/v1/models/clf/predict", json={"instances": x.tolist()})
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        sent[request_id] = x
        outputs[request_id] = np.array(response.json()["predictions"])

        rows = {rid: wait_until(lambda rid=rid: logged(client, rid), 15) for rid in sent}
        for request_id, x in sent.items():
            (row,) = rows[request_id]
            assert (row["version"], row["status"], row["label"]) == (1, 200, None)
            assert row["trace_id"] and row["latency_ms"] > 0
            for j in range(4):
                np.testing.assert_allclose(row["inputs"][f"x[{j}]"], x[:, j], rtol=1e-6)
            np.testing.assert_allclose(row["outputs"]["y"], outputs[request_id], rtol=1e-5)
            logits = outputs[request_id]
            positive = 1 / (1 + np.exp(logits[:, 0] - logits[:, 1]))  # softmax, class 1
            np.testing.assert_allclose(row["scores"], positive, rtol=1e-5)

        # Labels: the predicted class everywhere but the first row of one request.
        labels = {rid: out.argmax(axis=1).tolist() for rid, out in outputs.items()}
        wrong = next(iter(labels))
        labels[wrong][0] = 1 - labels[wrong][0]
        items = [{"request_id": rid, "label": label} for rid, label in labels.items()]
        fed = client.post("/api/v1/feedback", json={"items": items})
        assert fed.json() == {"accepted": 5, "matched": 5}
        assert logged(client, wrong)[0]["label"] == labels[wrong]

        series = client.get("/api/v1/models/clf/quality").json()["series"]
        assert sum(p["labelled"] for p in series) == 5
        assert sum(p["labelled_rows"] for p in series) == 11  # 4 requests of 2 rows, one of 3
        right = sum(p["accuracy"] * p["labelled_rows"] for p in series if p["labelled_rows"])
        assert right == pytest.approx(10)  # one wrong row (the hours may split the requests)

    with httpx.Client(base_url=url, headers=auth(key_b), timeout=30) as other:
        assert other.get("/api/v1/models/clf/predictions").status_code == 404
        assert other.post("/api/v1/feedback", json={"items": items}).json()["matched"] == 0


def test_a_locked_database_leaves_requests_fast_and_the_log_whole(platform, rng):
    backend, url, key_a, _ = platform
    dropped_before = dropped(url)
    holder = sqlite3.connect(
        backend.var_dir / "switchyard.sqlite3", timeout=5, isolation_level=None
    )
    holder.execute("BEGIN IMMEDIATE")  # another writer holds SQLite's write lock
    slowest = 0.0
    try:
        with httpx.Client(base_url=url, headers=auth(key_a), timeout=30) as client:
            for i in range(300):
                x = rng.normal(size=(1, 4)).astype(np.float32)
                started = time.perf_counter()
                response = client.post(
                    "/v2/models/clf/infer", **oip(x, **{"x-request-id": f"locked-{i}"})
                )
                slowest = max(slowest, time.perf_counter() - started)
                assert response.status_code == 200, response.text
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert slowest < 1.0
    # The log's files do not wait on the database: nothing was dropped, everything is there.
    assert dropped(url) - dropped_before == 0
    with httpx.Client(base_url=url, headers=auth(key_a), timeout=30) as client:
        for i in range(300):
            wait_until(lambda i=i: logged(client, f"locked-{i}"), 30)
