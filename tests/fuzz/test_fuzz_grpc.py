"""Hypothesis-generated ``ModelInferRequest`` messages, and bytes that are no message at all,
sent to the OIP v2 gRPC server (a real ``grpc.aio`` server on a local port, its own event
loop): no call ends INTERNAL or UNKNOWN; a refusal is INVALID_ARGUMENT (or the status its
cause maps to) with a message."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import pytest
from django.db import connections
from hypothesis import given
from hypothesis import strategies as st

from gateway import grpc_server
from gateway.proto import grpc_predict_v2_pb2 as pb
from serving_agent.protocol import OIP_TO_NUMPY
from tests.fuzz.conftest import Platform
from tests.fuzz.strategies import fuzz

# The handlers run on the server's loop: the gateway's database calls on its own threads.
pytestmark = pytest.mark.db_threads

INFER = f"/{grpc_server.SERVICE}/ModelInfer"
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}

# Protobuf strings are UTF-8: a client cannot send a lone surrogate in one.
utf8 = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=10) | st.sampled_from(
    ["", "x", "y", "clf", "²", "\u0000", "FP32"]
)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
shapes = st.lists(st.integers(-2, 6) | int64, max_size=4) | st.sampled_from(
    [[1, 4], [2, 4], [1] * 70]
)
parameters = st.dictionaries(
    utf8,
    st.builds(pb.InferParameter, bool_param=st.booleans())
    | st.builds(pb.InferParameter, int64_param=int64)
    | st.builds(pb.InferParameter, string_param=utf8)
    | st.just(pb.InferParameter()),
    max_size=3,
)
contents = st.builds(
    pb.InferTensorContents,
    fp32_contents=st.lists(st.floats(width=32), max_size=10),
    int64_contents=st.lists(int64, max_size=5),
    bool_contents=st.lists(st.booleans(), max_size=5),
    bytes_contents=st.lists(st.binary(max_size=4) | st.just(b"\xff\xfe"), max_size=3),
)
tensors = st.builds(
    pb.ModelInferRequest.InferInputTensor,
    name=st.sampled_from(["x", "t"]) | utf8,
    datatype=st.sampled_from(sorted(OIP_TO_NUMPY)) | utf8,
    shape=shapes,
    contents=contents,
)
requests = st.builds(
    pb.ModelInferRequest,
    model_name=st.sampled_from(["clf", "clf", "echo", "nope"]) | utf8,
    model_version=st.sampled_from(["", "", "1", "²", "0", "99999999999999999999"]) | utf8,
    id=utf8,
    inputs=st.lists(tensors, max_size=2),
    outputs=st.lists(
        st.builds(pb.ModelInferRequest.InferRequestedOutputTensor, name=st.just("y") | utf8),
        max_size=2,
    ),
    # Raw buffers: random bytes, and BYTES elements behind honest or lying length prefixes.
    raw_input_contents=st.lists(
        st.binary(max_size=20)
        | st.builds(
            lambda n, body: n.to_bytes(4, "little") + body,
            st.sampled_from([0, 1, 2, 5, 2**31]),
            st.binary(max_size=6),
        ),
        max_size=2,
    ),
).map(lambda message: message.SerializeToString())
payloads = requests | st.binary(max_size=64)


@pytest.fixture
def address(platform: Platform, monkeypatch) -> Iterator[str]:
    """A started gRPC server on a loop of its own thread, as in a server process."""
    # Each gateway database call's connection closes after it: none outlives the test database.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = grpc_server.start_server("127.0.0.1", 0, 1 << 20)
    server, port = asyncio.run_coroutine_threadsafe(start, loop).result(10)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@fuzz(200)
# Metadata values are ASCII (a client library refuses others before sending).
@given(payload=payloads, priority=st.none() | st.sampled_from(["2", "x", "-1", "1" * 40]))
def test_infer_messages_never_end_in_a_server_fault(
    platform: Platform, address: str, payload: bytes, priority: str | None
) -> None:
    metadata = [("authorization", f"Bearer {platform.key}")]
    if priority is not None:
        metadata.append(("x-switchyard-timeout-ms", priority))
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary(INFER)  # bytes in, bytes out: any payload goes
        try:
            pb.ModelInferResponse.FromString(infer(payload, metadata=metadata, timeout=10))
        except grpc.RpcError as error:
            assert error.code() not in SERVER_FAULTS, (error.code(), error.details())
            assert error.details(), error.code()


def test_bytes_that_are_no_message_are_invalid_argument(platform: Platform, address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(INFER)(b"\xff\xff\xff", timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid ModelInferRequest" in refused.value.details()
