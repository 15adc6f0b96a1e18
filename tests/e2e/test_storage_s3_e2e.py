"""A platform with its artifacts in S3 (moto's real S3 server) and a real agent process: the
agent downloads by presigned URL straight from the bucket and serves predictions, refuses an
object changed in the bucket, and serves a version registered by reference."""

from __future__ import annotations

import httpx
import pytest

from tests.onnx_models import small_onnx
from tests.s3_server import s3_server

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import create_node, create_tenant, free_port, start_agent, start_server, wait_until

pytestmark = pytest.mark.e2e

ROW = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1, 0.2, 0.3, 0.4]}]}


def point(client: httpx.Client, alias: str, number: int) -> None:
    """An unprotected alias: the version is served at once (production needs an approval)."""
    moved = client.put(f"/api/v1/models/clf/aliases/{alias}", json={"version": number})
    assert moved.status_code == 200, moved.text


def test_agent_serves_from_the_bucket_and_refuses_a_tampered_object(tmp_path):
    with s3_server() as s3:
        bucket = s3.new_bucket()
        bucket_client = s3.client()
        backend = make_backend("embedded", tmp_path)
        backend.env.update(s3.env(bucket))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs = [start_server(backend, "uvicorn", port)]
        try:
            key = create_tenant(backend, "alpha")
            agent = start_agent(backend, url, create_node(backend, "n"))
            procs.append(agent)
            with httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
            ) as client:
                # An upload lands in the bucket; the agent fetches it from there and serves it.
                first = upload_and_promote(client, "clf", small_onnx())
                wait_ready(client, "clf", proc=agent)
                assert client.post("/v2/models/clf/infer", json=ROW).status_code == 200
                keys = [o["Key"] for o in bucket_client.list_objects_v2(Bucket=bucket)["Contents"]]
                assert any(first["sha256"] in k for k in keys)

                # Changed in the bucket after registration: the agent refuses it.
                files = {"artifact": ("m.onnx", small_onnx(seed=1), "application/octet-stream")}
                second = client.post("/api/v1/models/clf/versions", files=files).json()
                stored = next(
                    o["Key"]
                    for o in bucket_client.list_objects_v2(Bucket=bucket)["Contents"]
                    if second["sha256"] in o["Key"]
                )
                bucket_client.put_object(Bucket=bucket, Key=stored, Body=small_onnx(seed=2))
                point(client, "staging", second["version"])
                wait_until(lambda: "sha256 mismatch" in agent.log(), 30, agent)
                assert client.get("/v2/models/clf/versions/2/ready").status_code != 200

                # Registered by reference: read once by the platform, fetched by the agent.
                ref = "imports/alpha/reference.onnx"
                bucket_client.put_object(Bucket=bucket, Key=ref, Body=small_onnx(seed=3))
                third = client.post(
                    "/api/v1/models/clf/versions", data={"artifact_uri": f"s3://{bucket}/{ref}"}
                )
                assert third.status_code == 201, third.text
                point(client, "candidate", third.json()["version"])
                ready = "/v2/models/clf/versions/3/ready"
                wait_until(lambda: client.get(ready).status_code == 200, 30, agent)
                infer = client.post("/v2/models/clf/versions/3/infer", json=ROW)
                assert infer.status_code == 200, infer.text
        finally:
            for proc in reversed(procs):
                proc.stop()
            backend.close()
