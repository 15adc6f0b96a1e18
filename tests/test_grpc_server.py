"""The gRPC front door in process: a real ``grpc.aio`` server on a local port, the real pipeline
and gateway state against the test database, and an agent link that runs the model with ONNX
Runtime. Calls go through tritonclient's own gRPC client and messages, as users' would; every
refusal is a gRPC status with a message that names the problem (never UNKNOWN or INTERNAL)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from asgiref.sync import async_to_sync
from django.db import connections
from tritonclient.grpc import aio as triton_aio
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.grpc import service_pb2_grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from gateway import grpc_server
from gateway.dispatch import AgentLink
from gateway.state import GatewayState
from serving_agent._serving import result_frame
from serving_agent.protocol import InferRequest, decode_frame, unpack_frames
from tests.e2e.harness import free_port
from tests.factories import make_key, make_model, make_tenant, make_version

# The handlers run in tasks gRPC starts, outside the test's context, so the gateway's database
# calls run on its own thread pool as in a server, and the rows must be committed to be seen.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.db_threads]


class OnnxLink:
    """An agent link in this process that answers each request with ONNX Runtime."""

    def __init__(self, state: GatewayState, artifact: bytes) -> None:
        self.state = state
        self.session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
        self.link = AgentLink("in-process", self.receive)
        self.requests: list[InferRequest] = []  # each frame as the agent received it
        state.pool.add(self.link)

    async def receive(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            request, arrays = decode_frame(frame)
            assert isinstance(request, InferRequest)
            self.requests.append(request)
            feeds = {t.name: a for t, a in zip(request.inputs, arrays, strict=True)}
            outputs = self.session.run(None, feeds)
            self.state.pool.deliver(self.link, result_frame(request.id, ["y"], outputs))


@dataclass
class Site:
    state: GatewayState  # each serve() makes a new one: its Redis client belongs to one loop
    key_a: str
    key_b: str
    version_id: int
    artifact: bytes


@pytest.fixture
def site(world, onnx_bytes, monkeypatch) -> Site:
    # Each gateway database call's connection is closed after it, so none outlives the test
    # database (or carries this test's settings into the next).
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    state = GatewayState()
    version = make_version(make_model(world.a), onnx_bytes)
    make_model(world.b, "theirs")
    site = Site(state, world.key_a, world.key_b, version.pk, onnx_bytes)
    monkeypatch.setattr(grpc_server, "get_state", lambda: site.state)
    return site


def serve(
    site: Site, scenario: Callable[[str], Awaitable[Any]], agent: bool = True, **limits: int
) -> Any:
    """Run ``scenario(address)`` against a started server (with the in-process agent ready)."""

    async def run() -> Any:
        site.state = GatewayState()
        if agent:
            add_agent(site)
        server, port = await grpc_server.start_server(
            "127.0.0.1", 0, limits.get("max_message_bytes", 1 << 20)
        )
        try:
            return await scenario(f"127.0.0.1:{port}")
        finally:
            await server.stop(None)

    return async_to_sync(run)()


def add_agent(site: Site) -> OnnxLink:
    agent = OnnxLink(site.state, site.artifact)
    site.state.pool.set_ready(agent.link, site.version_id, True)
    return agent


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def x_input(x: np.ndarray) -> triton_aio.InferInput:
    tensor = triton_aio.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def test_tritonclient_predicts_with_raw_tensors_as_onnx_runtime_does(site, rng):
    x = rng.normal(size=(5, 4)).astype(np.float32)

    async def scenario(address: str) -> Any:
        async with triton_aio.InferenceServerClient(address) as client:
            headers = {"authorization": f"Bearer {site.key_a}"}
            assert await client.is_server_live()
            assert await client.is_model_ready("clf", headers=headers)
            meta = await client.get_model_metadata("clf", headers=headers, as_json=True)
            server = await client.get_server_metadata(as_json=True)
            result = await client.infer("clf", [x_input(x)], request_id="r-7", headers=headers)
            return meta, server, result

    meta, server, result = serve(site, scenario)
    assert server["name"] == "switchyard"
    assert meta["versions"] == ["1"] and meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("clf", "1", "r-7")
    assert len(response.raw_output_contents) == 1  # raw in, raw out, as tritonclient expects
    want = ort.InferenceSession(site.artifact).run(None, {"x": x})[0]
    np.testing.assert_allclose(result.as_numpy("y"), want, rtol=1e-5, atol=1e-6)


def test_typed_contents_are_answered_with_typed_contents(site):
    request = triton_pb.ModelInferRequest(model_name="clf", model_version="1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([1, 2, 3, 4])

    async def scenario(address: str) -> Any:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = triton_grpc.GRPCInferenceServiceStub(channel)
            return await stub.ModelInfer(request, metadata=bearer(site.key_a))

    reply = serve(site, scenario)
    want = ort.InferenceSession(site.artifact).run(None, {"x": np.array([[1, 2, 3, 4]], "f4")})
    assert not reply.raw_output_contents and list(reply.outputs[0].shape) == [1, 2]
    got = np.array(reply.outputs[0].contents.fp32_contents, np.float32)
    np.testing.assert_allclose(got, want[0].ravel(), rtol=1e-5, atol=1e-6)


def call(
    site: Site,
    method: str,
    request: Any,
    metadata: list[tuple[str, str]] | None = None,
    agent: bool = True,
    **limits: int,
) -> grpc.aio.AioRpcError:
    """Make one call that must fail; its error."""

    async def scenario(address: str) -> Any:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = triton_grpc.GRPCInferenceServiceStub(channel)
            try:
                await getattr(stub, method)(request, metadata=metadata)
            except grpc.aio.AioRpcError as error:
                return error
            raise AssertionError(f"{method} answered")

    return serve(site, scenario, agent, **limits)


def infer_request(x: np.ndarray, model: str = "clf", datatype: str = "FP32", blob=None):
    request = triton_pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype=datatype, shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes() if blob is None else blob)
    return request


X = np.ones((2, 4), np.float32)


def test_a_missing_or_wrong_key_is_unauthenticated(site):
    missing = call(site, "ModelInfer", infer_request(X))
    assert missing.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "missing API key" in missing.details()
    wrong = call(site, "ModelInfer", infer_request(X), bearer("sy_wrong"))
    assert wrong.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "invalid or revoked API key" in wrong.details()
    ready = call(site, "ModelReady", triton_pb.ModelReadyRequest(name="clf"))
    assert ready.code() is grpc.StatusCode.UNAUTHENTICATED


def test_another_tenants_model_is_not_found(site):
    for method, request in [
        ("ModelInfer", infer_request(X)),
        ("ModelMetadata", triton_pb.ModelMetadataRequest(name="clf")),
        ("ModelReady", triton_pb.ModelReadyRequest(name="clf")),
    ]:
        error = call(site, method, request, bearer(site.key_b))
        assert error.code() is grpc.StatusCode.NOT_FOUND, method
        assert "clf" in error.details()
    # ...and the other way round: alpha's key does not reach beta's model.
    theirs = call(site, "ModelMetadata", triton_pb.ModelMetadataRequest(name="theirs"))
    assert theirs.code() is grpc.StatusCode.UNAUTHENTICATED
    theirs = call(
        site, "ModelMetadata", triton_pb.ModelMetadataRequest(name="theirs"), bearer(site.key_a)
    )
    assert theirs.code() is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    "request_, message",
    [
        (infer_request(X, datatype="INT64"), "the model expects FP32, got INT64"),
        (infer_request(X, blob=X.tobytes()[:-4]), "needs 32 bytes, got 28"),
        (infer_request(np.ones((1, 3), np.float32)), "does not match the signature"),
        (infer_request(np.full((1, 4), np.inf, np.float32)), "NaN or infinity"),
        (triton_pb.ModelInferRequest(model_name="clf"), "at least one tensor"),
    ],
    ids=["datatype", "raw-length", "shape", "infinity", "empty"],
)
def test_hostile_tensors_are_invalid_argument(site, request_, message):
    error = call(site, "ModelInfer", request_, bearer(site.key_a))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


def test_a_shape_whose_product_overflows_is_invalid_argument(site):
    request = infer_request(X)
    request.inputs[0].ClearField("shape")
    request.inputs[0].shape.extend([2**62, 2**62])
    error = call(site, "ModelInfer", request, bearer(site.key_a))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_a_bad_version_is_invalid_argument(site):
    request = triton_pb.ModelReadyRequest(name="clf", version="One")
    error = call(site, "ModelReady", request, bearer(site.key_a))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "version must be a positive integer" in error.details()


def test_a_message_over_the_size_limit_is_resource_exhausted(site):
    big = np.ones((4096, 4), np.float32)  # 64 KiB of tensor against a 16 KiB limit
    error = call(
        site, "ModelInfer", infer_request(big), bearer(site.key_a), max_message_bytes=16384
    )
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_over_the_rate_limit_is_resource_exhausted_with_a_retry_hint(site):
    slow = make_tenant("slow", rps=0.01, burst=1)
    make_version(make_model(slow), site.artifact)
    key = make_key(slow)[1]

    async def scenario(address: str) -> Any:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = triton_grpc.GRPCInferenceServiceStub(channel)
            first = await stub.ModelMetadata(
                triton_pb.ModelMetadataRequest(name="clf"), metadata=bearer(key)
            )
            try:
                await stub.ModelMetadata(
                    triton_pb.ModelMetadataRequest(name="clf"), metadata=bearer(key)
                )
            except grpc.aio.AioRpcError as error:
                return first, error
            raise AssertionError("the second call was not limited")

    first, error = serve(site, scenario)
    assert first.name == "clf"
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate limit exceeded for tenant 'slow'" in error.details()
    trailers = dict(error.trailing_metadata())
    assert int(trailers["retry-after"]) >= 1
    assert int(trailers["grpc-retry-pushback-ms"]) == 1000 * int(trailers["retry-after"])


def test_no_ready_agent_is_unavailable_with_a_retry_hint(site):
    error = call(site, "ModelInfer", infer_request(X), bearer(site.key_a), agent=False)
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert "no serving agent is ready" in error.details()
    trailers = dict(error.trailing_metadata())
    assert trailers["retry-after"] == "1" and trailers["grpc-retry-pushback-ms"] == "1000"
    assert trailers["x-request-id"]  # the trace ids come back on failures too


def test_server_ready_says_what_rest_readiness_says(site):
    async def scenario(address: str) -> tuple[bool, bool]:
        async with triton_aio.InferenceServerClient(address) as client:
            before = await client.is_server_ready()  # no refresh has read the configuration
            site.state.refreshed_at = time.monotonic()
            assert site.state.serving_ready()
            return before, await client.is_server_ready()

    assert serve(site, scenario) == (False, True)


def test_model_ready_follows_the_agent(site):
    async def scenario(address: str) -> tuple[bool, bool]:
        headers = {"authorization": f"Bearer {site.key_a}"}
        async with triton_aio.InferenceServerClient(address) as client:
            before = await client.is_model_ready("clf", headers=headers)
            add_agent(site)
            return before, await client.is_model_ready("clf", headers=headers)

    assert serve(site, scenario, agent=False) == (False, True)


def test_a_client_error_from_tritonclient_carries_the_status(site):
    async def scenario(address: str) -> InferenceServerException:
        async with triton_aio.InferenceServerClient(address) as client:
            try:
                await client.infer("clf", [x_input(X)], headers={"authorization": "Bearer nope"})
            except InferenceServerException as exc:
                return exc
            raise AssertionError("answered")

    exc = serve(site, scenario)
    assert exc.status() == "StatusCode.UNAUTHENTICATED"
    assert "invalid or revoked API key" in exc.message()


def test_the_port_setting_starts_the_server_or_leaves_it_off(settings, site):
    settings.SWITCHYARD_GRPC_HOST = "127.0.0.1"

    async def start() -> tuple[int | None, bool]:
        bound = await grpc_server.start()
        live = False
        if bound is not None:
            async with triton_aio.InferenceServerClient(f"127.0.0.1:{bound}") as client:
                live = await client.is_server_live()
        await grpc_server.stop()
        return bound, live

    settings.SWITCHYARD_GRPC_PORT = 0
    assert async_to_sync(start)() == (None, False)
    settings.SWITCHYARD_GRPC_PORT = free_port()
    assert async_to_sync(start)() == (settings.SWITCHYARD_GRPC_PORT, True)


def test_priority_timeout_and_the_grpc_deadline_travel_to_the_agent(site):
    agents: list[OnnxLink] = []

    async def scenario(address: str) -> Any:
        agents.append(add_agent(site))  # the only agent: it sees every frame
        headers = {"authorization": f"Bearer {site.key_a}"}
        async with triton_aio.InferenceServerClient(address) as client:
            # Triton's integers: 3 is batch; timeout in microseconds.
            await client.infer("clf", [x_input(X)], headers=headers, priority=3, timeout=250_000)
            await client.infer("clf", [x_input(X)], headers=headers, client_timeout=2.0)
            try:  # the key is interactive: critical is above its ceiling
                await client.infer("clf", [x_input(X)], headers=headers, priority=1)
            except InferenceServerException as exc:
                return exc
        raise AssertionError("critical was served for an interactive key")

    refused = serve(site, scenario, agent=False)
    assert refused.status() == "StatusCode.PERMISSION_DENIED"
    assert "above what this API key may ask for" in refused.message()
    frames = [r for agent in agents for r in agent.requests]
    assert [f.priority for f in frames] == [2, 1]  # batch, then the key's interactive
    assert frames[0].budget_ms == 250.0
    # The deadline as gRPC carries it (its timeout header rounds up a little), under 10 s.
    assert frames[1].budget_ms is not None and 1000 < frames[1].budget_ms <= 2100
    assert all(f.tenant and f.key for f in frames)  # whose request it is, for fairness


def test_a_malformed_timeout_parameter_is_invalid_argument(site):
    request = infer_request(X)
    request.parameters["timeout"].string_param = "soon"
    error = call(site, "ModelInfer", request, bearer(site.key_a))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "parameters.timeout" in error.details()


def test_a_retried_infer_with_the_same_idempotency_key_is_computed_once(site):
    first, other = infer_request(X), infer_request(X * 2)
    keyed = [*bearer(site.key_a), ("idempotency-key", "txn-7")]

    async def scenario(address: str) -> Any:
        agent = add_agent(site)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = triton_grpc.GRPCInferenceServiceStub(channel)
            answers = []
            for _ in range(2):
                done = stub.ModelInfer(first, metadata=keyed)
                answers.append((await done, dict(await done.trailing_metadata())))
            try:
                await stub.ModelInfer(other, metadata=keyed)
            except grpc.aio.AioRpcError as error:
                return answers, error, len(agent.requests)
        raise AssertionError("the same key for another request was answered")

    answers, mismatch, computed = serve(site, scenario, agent=False)
    (one, one_call), (two, two_call) = answers
    assert one == two and one.outputs
    assert "idempotent-replayed" not in one_call
    assert two_call["idempotent-replayed"] == "true"
    assert computed == 1  # the retry was the first answer again, never sent to the agent
    assert mismatch.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "idempotency" in mismatch.details().lower()
