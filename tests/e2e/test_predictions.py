"""The platform end to end: upload through the API, promote, predict over OIP v2 and the
prediction API (its lean front door, gateway/api/predict_app.py, in the real server), and
compare with ONNX Runtime run in the test process."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from registry.models import Model, ModelVersion
from serving_agent.protocol import (
    AGENT_WS_PATH,
    CLOSE_CLAIM_REFUSED,
    Assign,
    Hello,
    VersionStatus,
)

from .conftest import upload_and_promote, wait_ready
from .harness import allow_weight, wait_until

pytestmark = pytest.mark.e2e


# JSON as Python's json.dumps writes non-finite floats (which strict parsers refuse).
NAN_BODY = (
    b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [VALUE, 0, 0, 0]}]}'
)


def expected(artifact: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def oip_body(x: np.ndarray, request_id: str = "req-1") -> dict:
    return {
        "id": request_id,
        "inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ],
    }


def test_oip_v2_predictions_equal_onnx_runtime(stack, rng):
    x = rng.normal(size=(5, 4)).astype(np.float32)
    with stack.client() as client:
        response = client.post("/v2/models/clf/infer", json=oip_body(x))
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["model_name"], body["model_version"], body["id"]) == ("clf", "1", "req-1")
        out = body["outputs"][0]
        assert (out["name"], out["datatype"], out["shape"]) == ("y", "FP32", [5, 2])
        got = np.array(out["data"], dtype=np.float32).reshape(5, 2)
        np.testing.assert_allclose(got, expected(stack.artifact, x), rtol=1e-5, atol=1e-6)
        by_version = client.post("/v2/models/clf/versions/1/infer", json=oip_body(x))
        assert by_version.json()["outputs"][0]["data"] == out["data"]


def test_concurrent_requests_each_get_their_own_rows(stack, rng):
    """Many clients at once: the gateway groups a turn's requests into one agent frame
    (docs/architecture.md, "Grouped infer frames") and splits the reply back; each client must
    get exactly the answer to its own rows, whatever it was grouped with. A model of its own:
    48 clients at once on a busy test machine spend the latency SLO's error budget, and the
    freeze that follows must not reach the other tests' model."""
    with stack.client() as client:
        upload_and_promote(client, "many", stack.artifact)
        wait_ready(client, "many", proc=stack.agent)
    xs = [rng.normal(size=(int(rng.integers(1, 4)), 4)).astype(np.float32) for _ in range(48)]

    async def all_at_once() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {stack.key_a}"}
        limits = httpx.Limits(max_connections=len(xs))
        async with httpx.AsyncClient(
            base_url=stack.url, headers=headers, timeout=30, limits=limits
        ) as client:
            return await asyncio.gather(
                *(
                    client.post("/v2/models/many/infer", json=oip_body(x, f"req-{i}"))
                    for i, x in enumerate(xs)
                )
            )

    for _ in range(3):
        responses = asyncio.run(all_at_once())
        for i, (x, response) in enumerate(zip(xs, responses, strict=True)):
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["id"] == f"req-{i}"
            got = np.array(body["outputs"][0]["data"], dtype=np.float32).reshape(len(x), 2)
            np.testing.assert_allclose(got, expected(stack.artifact, x), rtol=1e-5, atol=1e-6)


def test_prediction_api_takes_rows_and_columns(stack, rng):
    x = rng.normal(size=(3, 4)).astype(np.float32)
    want = expected(stack.artifact, x)
    with stack.client() as client:
        rows = client.post("/api/v1/models/clf/predict", json={"instances": x.tolist()})
        assert rows.status_code == 200, rows.text
        np.testing.assert_allclose(rows.json()["predictions"], want, rtol=1e-5, atol=1e-6)
        cols = client.post("/api/v1/models/clf/predict", json={"inputs": {"x": x.tolist()}})
        np.testing.assert_allclose(cols.json()["outputs"]["y"], want, rtol=1e-5, atol=1e-6)
        bad = client.post("/api/v1/models/clf/predict", json={"inputs": {"z": x.tolist()}})
        assert bad.status_code == 400 and "unknown input" in bad.json()["error"]
        by_version = client.post(
            "/api/v1/models/clf/versions/1/predict", json={"instances": x.tolist()}
        )
        assert (by_version.json()["model"], by_version.json()["version"]) == ("clf", 1)
        np.testing.assert_allclose(by_version.json()["predictions"], want, rtol=1e-5, atol=1e-6)
        assert rows.headers["traceparent"].startswith("00-") and rows.headers["x-request-id"]


@pytest.mark.parametrize(
    "content, content_type, status, words",
    [
        (b"{", "application/json", 400, "not valid JSON"),
        (b'{"instances": "abc"}', "application/json", 400, "instances: Expected a list"),
        (b'{"instances": [[1e39, 0, 0, 0]]}', "application/json", 400, "NaN or infinity"),
        (b'{"instances": ["\xff"]}', "application/json", 400, "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "application/json", 400, "not valid JSON"),
        (b"instances=1", "application/x-www-form-urlencoded", 415, "application/json"),
        (b" " * (17 * 1024 * 1024), "application/json", 413, "larger than the limit"),
    ],
)
def test_prediction_api_refuses_bad_bodies_in_its_error_shape(
    stack, content, content_type, status, words
):
    with stack.client() as client:
        response = client.post(
            "/api/v1/models/clf/predict", content=content, headers={"Content-Type": content_type}
        )
    assert response.status_code == status, response.text
    assert words in response.json()["error"] and "Traceback" not in response.text


def test_prediction_api_keys_and_methods(stack):
    row = {"instances": [[0.0, 0.0, 0.0, 0.0]]}
    with stack.client("sy_deadbeef_nope") as client:
        refused = client.post("/api/v1/models/clf/predict", json=row)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    with stack.client() as client:
        assert client.post("/api/v1/models/nope/predict", json=row).status_code == 404
        assert client.get("/api/v1/models/clf/predict").status_code == 405  # DRF's answer


def test_metadata_and_health_follow_the_protocol(stack):
    with stack.client() as client:
        assert client.get("/v2/health/live").json() == {"live": True}
        assert client.get("/v2/health/ready").status_code == 200
        meta = client.get("/v2/models/clf").json()
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
        assert meta["versions"] == ["1"]
        assert client.get("/v2/models/clf/versions/1/ready").json() == {
            "name": "clf",
            "ready": True,
        }


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{", 400, "not valid JSON"),
        (
            {"inputs": [{"name": "nope", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]},
            400,
            "unknown input 'nope'",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "INT32", "data": [0] * 4}]},
            400,
            "expects FP32, got INT32",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 3}]},
            400,
            "holds 4 values but data has 3",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [0] * 3}]},
            400,
            "does not match the signature",
        ),
        (
            NAN_BODY.replace(b"VALUE", b"NaN"),
            400,
            "NaN or infinity",
        ),
        (
            NAN_BODY.replace(b"VALUE", b"Infinity"),
            400,
            "NaN or infinity",
        ),
    ],
)
def test_bad_input_gets_a_4xx_naming_the_problem(stack, body, status, message):
    with stack.client() as client:
        if isinstance(body, bytes):
            response = client.post("/v2/models/clf/infer", content=body)
        else:
            response = client.post("/v2/models/clf/infer", json=body)
    assert response.status_code == status
    assert message in response.json()["error"]
    assert "Traceback" not in response.text


def test_oversized_body_gets_413(stack):
    with stack.client() as client:
        response = client.post("/v2/models/clf/infer", content=b" " * (17 * 1024 * 1024))
    assert response.status_code == 413 and "larger than the limit" in response.json()["error"]


def test_unknown_missing_and_revoked_keys_get_401(stack):
    with stack.client("sy_deadbeef_nope") as client:
        assert client.post("/v2/models/clf/infer", json={}).status_code == 401
    with stack.client() as client:
        client.headers.pop("Authorization")
        response = client.post("/v2/models/clf/infer", json={})
        assert response.status_code == 401 and "missing API key" in response.json()["error"]


def test_other_tenant_gets_404_on_every_data_path_endpoint(stack, rng):
    x = rng.normal(size=(1, 4)).astype(np.float32)
    with stack.client(stack.key_b) as client:
        for method, path in [
            ("GET", "/v2/models/clf"),
            ("GET", "/v2/models/clf/ready"),
            ("GET", "/v2/models/clf/versions/1"),
            ("POST", "/v2/models/clf/infer"),
            ("POST", "/v2/models/clf/versions/1/infer"),
        ]:
            response = client.request(method, path, json=oip_body(x))
            assert response.status_code == 404, (path, response.text)
            assert "not found" in response.json()["error"]
        predict = client.post("/api/v1/models/clf/predict", json={"instances": x.tolist()})
        assert predict.status_code == 404


def test_a_rogue_agent_with_another_tenants_node_token_gets_no_request(stack, rng):
    """An agent of tenant beta's node claims tenant alpha's version as ready: it is closed
    with CLOSE_CLAIM_REFUSED, and every request is answered by the real agent."""
    token = stack.backend.manage("create_node", f"rogue-{rng.integers(1 << 30)}", "--tenant",
                                 "beta", "--quiet").strip()  # fmt: skip
    (version_id,) = stack.backend.query(
        f"SELECT v.id FROM {ModelVersion._meta.db_table} v JOIN {Model._meta.db_table} m "
        "ON v.model_id = m.id WHERE m.name = 'clf' AND v.version = 1"
    )[0]
    ws_url = stack.url.replace("http://", "ws://") + AGENT_WS_PATH
    hello = Hello(agent_version="rogue", host="rogue", cpu_count=1, memory_bytes=1 << 30)
    with connect(ws_url, additional_headers={"Authorization": f"Bearer {token}"}) as rogue:
        rogue.send(hello.model_dump_json())
        assert Assign.model_validate_json(rogue.recv(timeout=10)).versions == []
        rogue.send(VersionStatus(version_id=version_id, state="ready").model_dump_json())
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                frame = rogue.recv(timeout=10)
                assert not isinstance(frame, bytes), "the rogue agent was sent a request"
        assert closed.value.rcvd is not None and closed.value.rcvd.code == CLOSE_CLAIM_REFUSED
        x = rng.normal(size=(1, 4)).astype(np.float32)
        with stack.client() as client:
            for _ in range(20):
                response = client.post("/v2/models/clf/infer", json=oip_body(x))
                assert response.status_code == 200, response.text


def test_unknown_routes_and_methods_are_clear(stack):
    with stack.client() as client:
        assert client.get("/v2/models/clf/infer").status_code == 405
        assert client.get("/v2/nothing").status_code == 404
        assert client.post("/v2/models/clf/versions/ABC/infer", json={}).status_code == 400


def test_canary_plan_splits_traffic_stickily_and_the_kill_switch_restores_baseline(stack, rng):
    """Runs last in this module: it adds version 2 and a plan, and kills the plan at the end."""
    from tests.onnx_models import small_onnx

    candidate = small_onnx(seed=5)
    x = rng.normal(size=(1, 4)).astype(np.float32)
    want = {"1": expected(stack.artifact, x), "2": expected(candidate, x)}
    guardrails = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 100}
    allow_weight(stack.backend, "alpha", 50)  # a 50/50 split without an approver
    with stack.client() as client:
        files = {"artifact": ("v2.onnx", candidate, "application/octet-stream")}
        assert client.post("/api/v1/models/clf/versions", files=files).status_code == 201
        plan = client.post(
            "/api/v1/models/clf/rollouts",
            json={"mode": "canary", "candidate": 2, "weight": 50, "guardrails": guardrails},
        )
        assert plan.status_code == 201, plan.text

        def answer(user: str) -> tuple[str, str]:
            r = client.post("/v2/models/clf/infer", json=oip_body(x), headers={"X-User-Id": user})
            assert r.status_code == 200, r.text
            body = r.json()
            got = np.array(body["outputs"][0]["data"], np.float32).reshape(1, 2)
            np.testing.assert_allclose(got, want[body["model_version"]], rtol=1e-5, atol=1e-6)
            arm = body.get("parameters", {}).get("arm")  # present while a plan routes
            assert r.headers.get("x-switchyard-arm") == arm
            return body["model_version"], arm

        # Agents load the candidate once the plan assigns it to them.
        wait_until(lambda: client.get("/v2/models/clf/versions/2/ready").status_code == 200, 30)
        first = {f"user-{i}": answer(f"user-{i}") for i in range(200)}
        assert {v for v, _ in first.values()} == {"1", "2"}
        assert all(answer(user) == seen for user, seen in list(first.items())[:40])
        share = sum(v == "2" for v, _ in first.values()) / len(first)
        assert 0.35 < share < 0.65

        killed = client.post(f"/api/v1/rollouts/{plan.json()['id']}/kill", json={"reason": "test"})
        assert killed.status_code == 200
        wait_until(lambda: all(answer(f"user-{i}")[0] == "1" for i in range(20)), 5)
