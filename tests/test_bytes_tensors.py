"""BYTES tensors through the front doors and the agent frames: JSON strings, Triton's binary
extension (tritonclient's own encoding) and gRPC, in and out, unchanged; hostile elements get a
400 naming the input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as triton_http
from django.conf import settings

from gateway import bytes_tensors
from gateway.errors import ApiError
from gateway.grpc_codec import parse_infer as parse_grpc
from gateway.grpc_codec import render_infer as render_grpc
from gateway.oip_codec import parse_infer, render_infer
from gateway.proto import grpc_predict_v2_pb2 as pb
from gateway.routes import InputSpec, Route
from serving_agent.protocol import (
    FrameError,
    InferRequest,
    InferResult,
    decode_frame,
    encode_frame,
    pack_bytes,
    tensor_of,
)

# The fuzz suite's in-process platform (its ``echo`` model has string tensors in and out).
from tests.fuzz.conftest import Platform, bearer, platform, request  # noqa: F401

JSON = (b"content-type", b"application/json")
TEXTS = ["héllo wörld", "", "a\u2603b", "x" * 300]


def route(text: bool) -> Route:
    spec = InputSpec("t", "BYTES", np.dtype(object), (-1,), text=text)
    return Route(
        tenant_id=1,
        model_name="m",
        version_id=1,
        model_id=1,
        version=1,
        task="embedding",
        inputs=(spec,),
        outputs=({"name": "u", "datatype": "BYTES", "shape": [-1]},),
        feature_names=(),
    )


def objects(values: list[bytes]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def test_json_strings_go_through_an_onnx_string_graph_unchanged(platform: Platform) -> None:  # noqa: F811
    body = {"inputs": [{"name": "t", "shape": [4], "datatype": "BYTES", "data": TEXTS}]}
    reply = request(
        "POST", "/v2/models/echo/infer", json.dumps(body).encode(), [bearer(platform.key), JSON]
    )
    assert reply.status == 200, reply.body
    (out,) = reply.json()["outputs"]
    assert out == {"name": "u", "datatype": "BYTES", "shape": [4], "data": TEXTS}


def test_tritonclient_binary_bytes_come_back_as_the_same_object_array(platform: Platform) -> None:  # noqa: F811
    values = np.array([t.encode() for t in TEXTS], dtype=np.object_)
    given = triton_http.InferInput("t", [4], "BYTES")
    given.set_data_from_numpy(values, binary_data=True)
    wanted = triton_http.InferRequestedOutput("u", binary_data=True)
    body, header_length = triton_http.InferenceServerClient.generate_request_body(
        [given], outputs=[wanted]
    )
    headers = [bearer(platform.key), JSON]
    headers.append((b"inference-header-content-length", str(header_length).encode()))
    reply = request("POST", "/v2/models/echo/infer", body, headers)
    assert reply.status == 200, reply.body
    length = int(reply.headers["inference-header-content-length"])
    result = triton_http.InferResult.from_response_body(reply.body, header_length=length)
    got = result.as_numpy("u")
    assert got.dtype == np.object_ and got.tolist() == values.tolist()


def test_json_bytes_may_be_nested_row_major() -> None:
    doc = {"inputs": [{"name": "t", "shape": [3], "datatype": "BYTES", "data": [["a", "b"], "c"]}]}
    parsed = parse_infer(json.dumps(doc).encode(), None, route(text=True))
    assert parsed.arrays[0].tolist() == [b"a", b"b", b"c"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "BYTES values must be strings (got int)"),
        ("ab", "must be a list of strings"),
        (["a"], "holds 2 values but data has 1"),
    ],
)
def test_json_bytes_that_are_not_strings_are_refused(data: object, message: str) -> None:
    doc = {"inputs": [{"name": "t", "shape": [2], "datatype": "BYTES", "data": data}]}
    with pytest.raises(ApiError) as refused:
        parse_infer(json.dumps(doc).encode(), None, route(text=True))
    assert refused.value.status == 400 and message in refused.value.message
    assert "('t')" in refused.value.message


def binary_body(elements: bytes, count: int) -> tuple[bytes, str]:
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "t",
                    "shape": [count],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(elements)},
                }
            ]
        }
    ).encode()
    return head + elements, str(len(head))


@pytest.mark.parametrize(
    ("elements", "count", "message"),
    [
        (b"\x05\x00\x00\x00ab", 1, "element 0 declares 5 bytes, past the end"),
        (b"\x01\x00\x00\x00a\x01\x00\x00", 2, "element 1's length runs past the end"),
        (b"\x01\x00\x00\x00a", 1000, "1000 elements need at least 4000 bytes"),
        (b"\x01\x00\x00\x00ab", 1, "1 bytes follow the 1 length-prefixed elements"),
        (b"\x02\x00\x00\x00\xc3(", 1, "element 0 is not valid UTF-8 text"),
    ],
)
def test_binary_bytes_with_lying_lengths_or_bad_text_are_400_naming_the_input(
    elements: bytes, count: int, message: str
) -> None:
    body, length = binary_body(elements, count)
    with pytest.raises(ApiError) as refused:
        parse_infer(body, length, route(text=True))
    assert refused.value.status == 400 and message in refused.value.message
    assert "inputs[0] ('t')" in refused.value.message


def test_invalid_utf8_is_fine_where_no_text_is_required() -> None:
    body, length = binary_body(b"\x02\x00\x00\x00\xc3(", 1)
    assert parse_infer(body, length, route(text=False)).arrays[0].tolist() == [b"\xc3("]


def test_elements_and_tensors_past_the_limits_are_refused(settings) -> None:
    settings.SWITCHYARD_MAX_BYTES_ELEMENT = 8
    settings.SWITCHYARD_MAX_BYTES_TENSOR = 20
    big = {"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["x" * 9]}]}
    with pytest.raises(ApiError, match="element 0 has 9 bytes; the limit is 8"):
        parse_infer(json.dumps(big).encode(), None, route(text=True))
    many = {"inputs": [{"name": "t", "shape": [3], "datatype": "BYTES", "data": ["x" * 8] * 3}]}
    with pytest.raises(ApiError, match="holds 24 bytes; the limit is 20"):
        parse_infer(json.dumps(many).encode(), None, route(text=True))


def test_bytes_outputs_render_as_json_strings_or_length_prefixed_binary() -> None:
    labels = np.array(["cat", "dög"])  # a numpy str array, as a classifier's labels come
    body, _ = render_infer(route(True), None, [("u", labels)], set())
    assert json.loads(body)["outputs"][0]["data"] == ["cat", "dög"]
    body, headers = render_infer(route(True), None, [("u", labels)], {"u"})
    length = int(dict(headers)["inference-header-content-length"])
    assert body[length:] == b"\x03\x00\x00\x00cat\x04\x00\x00\x00d\xc3\xb6g"


def test_grpc_bytes_contents_and_raw_contents_parse_and_render_the_same() -> None:
    typed = pb.ModelInferRequest(model_name="m")
    tensor = typed.inputs.add(name="t", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend([b"one", "twö".encode()])
    raw = pb.ModelInferRequest(model_name="m")
    raw.inputs.add(name="t", datatype="BYTES", shape=[2])
    raw.raw_input_contents.append(pack_bytes(objects([b"one", "twö".encode()])))
    for request_ in (typed, raw):
        assert parse_grpc(request_, route(True)).arrays[0].tolist() == [b"one", "twö".encode()]
    labels = objects(["a", "bc"])  # ONNX Runtime's str outputs
    typed_reply = render_grpc(route(True), None, [("u", labels)], raw=False)
    assert list(typed_reply.outputs[0].contents.bytes_contents) == [b"a", b"bc"]
    raw_reply = render_grpc(route(True), None, [("u", labels)], raw=True)
    assert raw_reply.raw_output_contents[0] == b"\x01\x00\x00\x00a\x02\x00\x00\x00bc"


def test_grpc_invalid_utf8_on_a_text_input_is_invalid_argument_naming_it() -> None:
    request_ = pb.ModelInferRequest(model_name="m")
    request_.inputs.add(name="t", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        b"\xff"
    )
    with pytest.raises(ApiError, match=r"inputs\[0\] \('t'\): element 0 is not valid UTF-8"):
        parse_grpc(request_, route(True))


def test_frames_carry_bytes_tensors_both_ways() -> None:
    texts = objects([b"a", b"", "ü".encode()])
    frame = encode_frame(InferRequest(id=1, version_id=2, inputs=[tensor_of("t", texts)]), [texts])
    _, (got,) = decode_frame(frame)
    assert got.dtype == object and got.tolist() == texts.tolist()
    labels = np.array([["x", "yz"]])  # str outputs travel as UTF-8 bytes
    _, (back,) = decode_frame(
        encode_frame(InferResult(id=1, outputs=[tensor_of("u", labels)]), [labels])
    )
    assert back.tolist() == [[b"x", b"yz"]]


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (b"\x09\x00\x00\x00abcd", "element 0 declares 9 bytes"),
        (b"\x01\x00", "need at least 8 bytes"),
        (b"\x01\x00\x00\x00a\x01\x00\x00\x00bc", "trailing bytes"),
    ],
)
def test_frames_with_inconsistent_bytes_lengths_are_refused(tail: bytes, message: str) -> None:
    head = encode_frame(InferResult(id=1, outputs=[tensor_of("u", objects([b"", b""]))]))
    with pytest.raises(FrameError, match=message):
        decode_frame(head + tail)


def test_json_nesting_cannot_exhaust_the_stack() -> None:
    deep: list = ["a"]
    for _ in range(5000):
        deep = [deep]
    assert bytes_tensors.from_json(deep).tolist() == [b"a"]
    assert settings.SWITCHYARD_MAX_BYTES_ELEMENT > 0


def test_the_prediction_api_takes_strings_for_a_bytes_input(
    platform: Platform,  # noqa: F811
) -> None:
    headers = [bearer(platform.key), JSON]
    body = json.dumps({"instances": ["héllo", "wörld"]}).encode()
    reply = request("POST", "/api/v1/models/echo/predict", body, headers)
    assert reply.status == 200, reply.body
    assert "héllo" in reply.body.decode() and "wörld" in reply.body.decode()
    refused = request("POST", "/api/v1/models/echo/predict", b'{"instances": [1, 2]}', headers)
    assert refused.status == 400 and "BYTES values must be strings" in refused.body.decode()
