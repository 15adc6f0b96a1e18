"""OpenTelemetry spans end to end (docs/observability.md, "Traces"): a real server process and a
real agent process export to an OTLP receiver the test starts, over gRPC and over HTTP; the
whole tree of one request arrives, each span under the right parent, from both processes; a
gRPC call's door span follows RPC's conventions; at ratio 0 an unsampled request sends
nothing, and a caller's sampled trace is followed (parent-based)."""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import pytest

from gateway.proto import grpc_predict_v2_pb2 as pb
from tests.onnx_models import small_onnx
from tests.otlp_receiver import Span, otlp_receiver

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import STACK_SEED, create_node, create_tenant, free_port, start_agent, start_server

pytestmark = pytest.mark.e2e

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
RPC_TRACE = "5bf92f3577b34da6a3ce929d0e0e4737"
CALLER_SPAN = "00f067aa0ba902b7"
STAGES = {
    "switchyard.auth",
    "switchyard.rate_limit",
    "switchyard.routing",
    "switchyard.serialization",
    "switchyard.dispatch",
}


def grpc_infer(address: str, key: str, traceparent: str) -> list[tuple[str, str]]:
    """One ModelInfer with its traceparent as metadata; the call's trailing metadata."""
    request = pb.ModelInferRequest(model_name="clf")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([0.5, -1.0, 2.0, 0.0])
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        metadata = (("authorization", f"Bearer {key}"), ("traceparent", traceparent))
        _, call = infer.with_call(request, metadata=metadata, timeout=10)
        return list(call.trailing_metadata())


def tree_below(spans: list[Span], door: Span) -> dict[str, list[Span]]:
    """The door's descendants by name, checked to hang together: each one's parent is in the
    trace, and a child from the same process lies within its parent's time (two processes'
    clocks agree only roughly)."""
    by_id = {s.span_id: s for s in spans}
    below: dict[str, list[Span]] = {}
    for span in spans:
        if span is door:
            continue
        parent = by_id[span.parent_id]  # KeyError: a span whose parent never arrived
        if parent.service == span.service:
            assert parent.start_ns <= span.start_ns and span.end_ns <= parent.end_ns
        below.setdefault(span.name, []).append(span)
    return below


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_one_requests_whole_tree_arrives_from_the_gateway_and_the_agent(protocol, tmp_path, rng):
    with otlp_receiver(protocol) as receiver:
        backend = make_backend("embedded", tmp_path, STACK_SEED)
        # Ratio 0: only callers' sampled traces are recorded (a fresh trace never is).
        backend.env.update(
            receiver.env(
                OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0"
            )
        )
        port, grpc_port = free_port(), free_port()
        url = f"http://127.0.0.1:{port}"
        procs = [start_server(backend, "uvicorn", port, grpc_port=grpc_port)]
        try:
            procs.append(start_agent(backend, url, create_node(backend, "node-1")))
            key = create_tenant(backend, "alpha")
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
                upload_and_promote(client, "clf", small_onnx())
                wait_ready(client, "clf", proc=procs[1])
                x = rng.normal(size=(3, 4)).astype(np.float32)
                body = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32"}]}
                body["inputs"][0]["data"] = x.ravel().tolist()
                fresh = client.post("/v2/models/clf/infer", json=body)
                sampled = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
                traced = client.post(
                    "/v2/models/clf/infer", json=body, headers={"traceparent": sampled}
                )
            trailers = dict(
                grpc_infer(f"127.0.0.1:{grpc_port}", key, f"00-{RPC_TRACE}-{CALLER_SPAN}-01")
            )

            assert fresh.status_code == traced.status_code == 200
            _, fresh_trace, _, fresh_flags = fresh.headers["traceparent"].split("-")
            _, trace_id, door_id, flags = traced.headers["traceparent"].split("-")
            assert (trace_id, flags, fresh_flags) == (CALLER_TRACE, "01", "00")

            # REST: the door (the span the response named), its stages, the agent's spans.
            found = receiver.wait_for(CALLER_TRACE, 11, timeout=20)
            (door,) = [s for s in found if s.span_id == door_id]
            assert door.parent_id == CALLER_SPAN and door.service == "switchyard-gateway"
            assert door.name == "POST /v2/models/{model}/infer"
            assert door.attributes["http.response.status_code"] == 200
            assert door.attributes["switchyard.tenant"] == "alpha"
            below = tree_below(found, door)
            assert {n for n in below if n.startswith("switchyard.") and "agent" not in n} == STAGES
            assert all(s.parent_id == door_id for n in STAGES for s in below[n])
            (on_agent,) = below["switchyard.agent.infer"]
            assert on_agent.service == "switchyard-agent" and on_agent.parent_id == door_id
            (queue,), (run,) = below["switchyard.agent.queue"], below["switchyard.agent.run"]
            assert queue.parent_id == run.parent_id == on_agent.span_id
            assert len(found) == 11

            # gRPC: the door's span is an RPC server span, named by the trailers' traceparent.
            _, rpc_trace, rpc_door, _ = trailers["traceparent"].split("-")
            assert rpc_trace == RPC_TRACE
            rpc = receiver.wait_for(RPC_TRACE, 11, timeout=20)
            (rpc_span,) = [s for s in rpc if s.span_id == rpc_door]
            assert rpc_span.name == "inference.GRPCInferenceService/ModelInfer"
            assert rpc_span.attributes["rpc.system"] == "grpc"
            assert rpc_span.attributes["rpc.grpc.status_code"] == 0
            assert "switchyard.agent.run" in tree_below(rpc, rpc_span)

            # The unsampled request sent nothing, from either process.
            assert receiver.of_trace(fresh_trace) == []
        finally:
            for proc in reversed(procs):
                proc.stop()
            backend.close()
