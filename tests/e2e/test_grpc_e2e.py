"""OIP v2 over gRPC end to end: uvicorn serving gRPC on a port of its own beside HTTP, a real
serving agent, and tritonclient's gRPC client as users run it; outputs equal ONNX Runtime's."""

from __future__ import annotations

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.onnx_models import small_onnx

from .conftest import BACKENDS, make_backend, upload_and_promote, wait_ready
from .harness import (
    create_node,
    create_tenant,
    free_port,
    services_available,
    start_agent,
    start_server,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=BACKENDS)
def grpc_stack(request, tmp_path_factory):
    backend = make_backend(request.param, tmp_path_factory.mktemp(request.param))
    port, grpc_port = free_port(), free_port()
    server = start_server(backend, "uvicorn", port, grpc_port=grpc_port)
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(backend, url, create_node(backend, "node-1"))
    key_a, key_b = create_tenant(backend, "alpha"), create_tenant(backend, "beta")
    artifact = small_onnx()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key_a}"}) as client:
        upload_and_promote(client, "clf", artifact)
        wait_ready(client, "clf", proc=agent)
    yield {"address": f"127.0.0.1:{grpc_port}", "key_a": key_a, "key_b": key_b, "art": artifact}
    agent.stop()
    server.stop()
    backend.close()


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def x_input(x: np.ndarray) -> triton.InferInput:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def test_tritonclient_grpc_works_unchanged(grpc_stack, rng):
    x = rng.normal(size=(6, 4)).astype(np.float32)
    headers = auth(grpc_stack["key_a"])
    with triton.InferenceServerClient(grpc_stack["address"]) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("clf", headers=headers)
        assert client.is_model_ready("clf", "1", headers=headers)
        meta = client.get_model_metadata("clf", headers=headers, as_json=True)
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
        outputs = [triton.InferRequestedOutput("y")]
        result = client.infer("clf", [x_input(x)], outputs=outputs, headers=headers)
    want = ort.InferenceSession(grpc_stack["art"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(result.as_numpy("y"), want, rtol=1e-5, atol=1e-6)
    assert result.get_response().model_version == "1"


def refusal(grpc_stack, key: str, call) -> InferenceServerException:
    with triton.InferenceServerClient(grpc_stack["address"]) as client:
        with pytest.raises(InferenceServerException) as caught:
            call(client, auth(key))
    return caught.value


def test_a_wrong_key_is_unauthenticated(grpc_stack):
    x = np.ones((1, 4), np.float32)
    exc = refusal(grpc_stack, "sy_wrong", lambda c, h: c.infer("clf", [x_input(x)], headers=h))
    assert exc.status() == "StatusCode.UNAUTHENTICATED"


def test_another_tenants_model_is_not_found(grpc_stack):
    x = np.ones((1, 4), np.float32)
    key_b = grpc_stack["key_b"]
    exc = refusal(grpc_stack, key_b, lambda c, h: c.infer("clf", [x_input(x)], headers=h))
    assert exc.status() == "StatusCode.NOT_FOUND" and "clf" in exc.message()
    exc = refusal(grpc_stack, key_b, lambda c, h: c.get_model_metadata("clf", headers=h))
    assert exc.status() == "StatusCode.NOT_FOUND"


def test_a_hostile_tensor_is_invalid_argument(grpc_stack):
    x = np.ones((1, 3), np.float32)  # the model takes [-1, 4]
    key_a = grpc_stack["key_a"]
    exc = refusal(grpc_stack, key_a, lambda c, h: c.infer("clf", [x_input(x)], headers=h))
    assert exc.status() == "StatusCode.INVALID_ARGUMENT"
    assert "does not match the signature" in exc.message()


def test_grpc_serves_under_daphne_which_sends_no_lifespan(tmp_path_factory, rng):
    """Daphne sends no ASGI lifespan events: its first request (the harness's liveness probe)
    starts gRPC and, with Redis, the agents' link address; SIGTERM stops them (the process
    deregisters its link address). One backend, the one with links when it is there."""
    name = "services" if services_available() else "embedded"
    backend = make_backend(name, tmp_path_factory.mktemp(f"daphne-{name}"))
    port, grpc_port = free_port(), free_port()
    server = start_server(backend, "daphne", port, grpc_port=grpc_port)
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(backend, url, create_node(backend, "node-1"))
    try:
        key, artifact = create_tenant(backend, "alpha"), small_onnx()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
            upload_and_promote(client, "clf", artifact)
            wait_ready(client, "clf", proc=agent)
        x = rng.normal(size=(3, 4)).astype(np.float32)
        with triton.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            assert client.is_server_ready()
            result = client.infer("clf", [x_input(x)], headers=auth(key))
        want = ort.InferenceSession(artifact).run(None, {"x": x})[0]
        np.testing.assert_allclose(result.as_numpy("y"), want, rtol=1e-5, atol=1e-6)
        if name == "services":
            links = "SELECT count(*) FROM fleet_gatewayprocess"
            assert backend.query(links) == [(1,)]  # daphne's link address, registered
            server.stop()  # SIGTERM: Twisted's shutdown stops gRPC and the links
            assert backend.query(links) == [(0,)], server.log()[-3000:]
            assert "Traceback" not in server.log(), server.log()[-3000:]
    finally:
        agent.stop()
        server.stop()
        backend.close()
