"""The gRPC codec: typed and raw tensors parse to the arrays the REST codec gives, every
malformed request is a 400 (INVALID_ARGUMENT) naming the field, and replies come back in the
form the request used. Seeded random requests stand in for hostile clients."""

from __future__ import annotations

import random
from dataclasses import replace

import grpc
import numpy as np
import pytest
from django.conf import settings

from gateway.errors import ApiError
from gateway.grpc_codec import grpc_code, parse_infer, render_infer, request_parameters
from gateway.proto import grpc_predict_v2_pb2 as pb
from gateway.routes import InputSpec, Route
from serving_agent.protocol import OIP_TO_NUMPY, pack_bytes


def route(*inputs: tuple[str, str, tuple[int, ...]]) -> Route:
    return Route(
        tenant_id=1,
        model_name="clf",
        version_id=9,
        model_id=2,
        version=3,
        task="classifier",
        inputs=tuple(InputSpec(n, d, OIP_TO_NUMPY[d], s) for n, d, s in inputs),
        outputs=({"name": "y", "datatype": "FP32", "shape": [-1, 2]},),
        feature_names=(),
    )


ROUTE = route(("x", "FP32", (-1, 4)))
X = np.arange(8, dtype=np.float32).reshape(2, 4)


def typed(x: np.ndarray = X, **fields) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="clf", id="r1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=x.shape)
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    for key, value in fields.items():
        setattr(tensor, key, value)
    return request


def raw(x: np.ndarray = X, datatype: str = "FP32", blob: bytes | None = None):
    request = pb.ModelInferRequest(model_name="clf")
    request.inputs.add(name="x", datatype=datatype, shape=x.shape)
    request.raw_input_contents.append(x.tobytes() if blob is None else blob)
    return request


def refused(request: pb.ModelInferRequest, where: Route = ROUTE) -> str:
    with pytest.raises(ApiError) as caught:
        parse_infer(request, where)
    assert caught.value.status == 400
    return caught.value.message


def test_typed_and_raw_tensors_parse_to_the_same_array():
    from_typed, from_raw = parse_infer(typed(), ROUTE), parse_infer(raw(), ROUTE)
    assert from_typed.id == "r1" and from_raw.id is None
    for parsed in (from_typed, from_raw):
        assert parsed.names == ["x"] and parsed.outputs is None
        np.testing.assert_array_equal(parsed.arrays[0], X)
        assert parsed.arrays[0].dtype == np.float32


@pytest.mark.parametrize(
    "datatype, field, values",
    [
        ("BOOL", "bool_contents", [True, False]),
        ("UINT8", "uint_contents", [0, 255]),
        ("UINT16", "uint_contents", [0, 65535]),
        ("UINT32", "uint_contents", [0, 2**32 - 1]),
        ("UINT64", "uint64_contents", [0, 2**64 - 1]),
        ("INT8", "int_contents", [-128, 127]),
        ("INT16", "int_contents", [-(2**15), 2**15 - 1]),
        ("INT32", "int_contents", [-(2**31), 2**31 - 1]),
        ("INT64", "int64_contents", [-(2**63), 2**63 - 1]),
        ("FP64", "fp64_contents", [0.5, -1e300]),
    ],
)
def test_every_typed_datatype_parses_and_renders_back(datatype, field, values):
    where = route(("x", datatype, (2,)))
    request = pb.ModelInferRequest(model_name="clf")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[2])
    getattr(tensor.contents, field).extend(values)
    array = parse_infer(request, where).arrays[0]
    assert array.dtype == OIP_TO_NUMPY[datatype] and array.tolist() == values
    reply = render_infer(where, None, [("y", array)], raw=False)
    assert reply.outputs[0].datatype == datatype
    assert list(getattr(reply.outputs[0].contents, field)) == values


@pytest.mark.parametrize(
    "datatype, field, values",
    [
        ("UINT8", "uint_contents", [256]),
        ("INT8", "int_contents", [-129]),
        ("INT16", "int_contents", [40000]),
    ],
)
def test_typed_values_out_of_the_datatypes_range_are_refused(datatype, field, values):
    request = pb.ModelInferRequest(model_name="clf")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[1])
    getattr(tensor.contents, field).extend(values)
    assert "out of range" in refused(request, route(("x", datatype, (1,))))


def test_fp16_travels_raw_only():
    where = route(("x", "FP16", (2,)))
    half = np.array([0.5, 2.0], np.float16)
    np.testing.assert_array_equal(parse_infer(raw(half, "FP16"), where).arrays[0], half)
    typed_half = pb.ModelInferRequest(model_name="clf")
    typed_half.inputs.add(name="x", datatype="FP16", shape=[2])
    assert "has no typed contents; send raw_input_contents" in refused(typed_half, where)
    # A typed request whose output is FP16 is answered raw: the protocol has no field for it.
    reply = render_infer(where, None, [("y", half)], raw=False)
    assert reply.raw_output_contents == [half.tobytes()] and not reply.outputs[0].HasField(
        "contents"
    )


def two_inputs() -> pb.ModelInferRequest:
    request = raw()
    request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    return request


def too_few_raw() -> pb.ModelInferRequest:
    request = raw()
    request.raw_input_contents.append(b"")
    return request


def both_forms() -> pb.ModelInferRequest:
    request = raw()
    request.inputs[0].contents.fp32_contents.append(1.0)
    return request


@pytest.mark.parametrize(
    "request_, message",
    [
        (pb.ModelInferRequest(model_name="clf"), "inputs: must hold at least one tensor"),
        (typed(name="z"), "unknown input 'z'"),
        (typed(datatype="INT64"), "expects FP32, got INT64"),
        (typed(datatype="BYTES"), "the model expects FP32, got BYTES"),
        (typed(datatype=""), "unsupported datatype ''"),
        (typed(np.arange(6, dtype=np.float32).reshape(2, 3)), "does not match the signature"),
        (typed(np.array([[np.nan, 0, 0, 0]], np.float32)), "contains NaN or infinity"),
        (raw(blob=X.tobytes()[:-1]), "needs 32 bytes, got 31"),
        (raw(blob=X.tobytes() + b"\0"), "needs 32 bytes, got 33"),
        (two_inputs(), "2 inputs; send one per input"),
        (too_few_raw(), "2 buffers for 1 inputs"),
        (both_forms(), "both contents and raw_input_contents given"),
    ],
    ids=[
        "no-inputs",
        "unknown-name",
        "wrong-datatype",
        "bytes",
        "empty-datatype",
        "wrong-shape",
        "nan",
        "raw-short",
        "raw-long",
        "raw-too-few",
        "raw-too-many",
        "both-forms",
    ],
)
def test_malformed_requests_are_invalid_argument_naming_the_problem(request_, message):
    assert message in refused(request_)


def test_a_name_given_twice_is_refused():
    request = typed()
    request.inputs.append(request.inputs[0])
    assert "input 'x' given twice" in refused(request)


def test_values_in_another_datatypes_field_are_named():
    request = pb.ModelInferRequest(model_name="clf")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    tensor.contents.fp64_contents.extend([1, 2, 3, 4])
    assert "FP32 values go in fp32_contents, not fp64_contents" in refused(request)


@pytest.mark.parametrize("shape", [[2**62, 2**62], [2**63 - 1, 4], [2**32, 2**32, 2**32]])
def test_a_shape_whose_product_overflows_int64_is_refused_without_allocating(shape):
    request = raw(blob=X.tobytes())
    request.inputs[0].ClearField("shape")
    request.inputs[0].shape.extend(shape)
    assert "bytes, got 32" in refused(request)
    request = typed()
    request.inputs[0].ClearField("shape")
    request.inputs[0].shape.extend(shape)
    assert "values but fp32_contents has 8" in refused(request)


def test_a_negative_dimension_is_refused():
    request = typed()
    request.inputs[0].shape[0] = -2
    assert "shape: must be non-negative" in refused(request)


def test_requested_outputs_must_exist():
    request = typed()
    request.outputs.add(name="y")
    assert parse_infer(request, ROUTE).outputs == ["y"]
    request.outputs.add(name="logits")
    assert "unknown output 'logits'" in refused(request)


def test_replies_take_the_requests_form_and_name_the_arm():
    y = np.array([[0.25, 0.75]], np.float32)
    typed_reply = render_infer(ROUTE, "r1", [("y", y)], raw=False, arm="canary")
    assert (typed_reply.model_name, typed_reply.model_version, typed_reply.id) == ("clf", "3", "r1")
    assert list(typed_reply.outputs[0].shape) == [1, 2] and not typed_reply.raw_output_contents
    assert list(typed_reply.outputs[0].contents.fp32_contents) == [0.25, 0.75]
    assert typed_reply.parameters["arm"].string_param == "canary"
    raw_reply = render_infer(ROUTE, None, [("y", y)], raw=True)
    assert raw_reply.raw_output_contents == [y.tobytes()] and "arm" not in raw_reply.parameters
    assert not raw_reply.outputs[0].HasField("contents")


def test_parameters_become_plain_values_and_an_empty_one_is_refused():
    request = typed()
    request.parameters["priority"].uint64_param = 2
    request.parameters["timeout"].int64_param = 500
    request.parameters["tag"].string_param = "a"
    request.parameters["debug"].bool_param = True
    request.parameters["scale"].double_param = 0.5
    assert request_parameters(request.parameters) == {
        "priority": 2,
        "timeout": 500,
        "tag": "a",
        "debug": True,
        "scale": 0.5,
    }
    request.parameters["empty"].SetInParent()
    with pytest.raises(ApiError, match=r"parameters\['empty'\]: holds no value"):
        request_parameters(request.parameters)


def test_triton_parameters_arrive_with_their_field_numbers():
    # tritonclient's own message, as it goes on the wire: priority is Triton's uint64_param.
    from tritonclient.grpc import service_pb2

    theirs = service_pb2.ModelInferRequest(model_name="clf")
    theirs.parameters["priority"].uint64_param = 7
    ours = pb.ModelInferRequest.FromString(theirs.SerializeToString())
    assert request_parameters(ours.parameters) == {"priority": 7}


@pytest.mark.parametrize(
    "status, code",
    [
        (400, grpc.StatusCode.INVALID_ARGUMENT),
        (401, grpc.StatusCode.UNAUTHENTICATED),
        (403, grpc.StatusCode.PERMISSION_DENIED),
        (404, grpc.StatusCode.NOT_FOUND),
        (413, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (503, grpc.StatusCode.UNAVAILABLE),
        (504, grpc.StatusCode.DEADLINE_EXCEEDED),
        (500, grpc.StatusCode.INTERNAL),
        (418, grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_http_statuses_map_to_grpc_codes(status, code):
    assert grpc_code(status) is code


# Hostile tensors: seeded random requests. Each starts valid for the route and takes 0-3
# random mutations; it either parses to arrays that agree with what it declared, or is refused
# with a 400. Nothing else may escape (a 5xx, an IndexError, an allocation sized by a hostile
# shape).
DATATYPES = [*OIP_TO_NUMPY, "BYTES", "STRING", ""]
HOSTILE_DIMS = [0, -1, 3, 2**31, 2**62, 2**63 - 1, -(2**63)]
ODD_VALUES: dict[str, list] = {
    "bool_contents": [True],
    "int_contents": [-1, 2**31 - 1, -(2**31)],
    "int64_contents": [-1, 2**63 - 1],
    "uint_contents": [256, 2**32 - 1],
    "uint64_contents": [2**64 - 1],
    "fp32_contents": [float("nan"), float("inf"), 3e38],
    "fp64_contents": [1e300, float("-inf")],
    "bytes_contents": [b"ab"],
}


def valid(rng: random.Random, where: Route, use_raw: bool) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="clf")
    for spec in where.inputs:
        shape = [d if d >= 0 else rng.randint(1, 3) for d in spec.shape]
        count = int(np.prod(shape))
        tensor = request.inputs.add(name=spec.name, datatype=spec.datatype, shape=shape)
        if spec.datatype == "BYTES":
            texts = [rng.choice(["", "héllo", "a b c"]).encode() for _ in range(count)]
            if use_raw:
                request.raw_input_contents.append(pack_bytes(np.array(texts, dtype=object)))
            else:
                tensor.contents.bytes_contents.extend(texts)
            continue
        values = np.array([rng.randint(0, 1) for _ in range(count)], spec.dtype)
        if use_raw:
            request.raw_input_contents.append(values.tobytes())
        else:
            getattr(tensor.contents, CONTENTS[spec.datatype]).extend(values.tolist())
    return request


def mutate(rng: random.Random, request: pb.ModelInferRequest) -> None:
    tensor = rng.choice(request.inputs)
    i = list(request.inputs).index(tensor)
    kind = rng.randrange(10)
    if kind == 0:
        tensor.name = rng.choice(["z", "", "x"])
    elif kind == 1:
        tensor.datatype = rng.choice(DATATYPES)
    elif kind == 2 and tensor.shape:
        tensor.shape[rng.randrange(len(tensor.shape))] = rng.choice(HOSTILE_DIMS)
    elif kind == 3:
        tensor.shape.append(rng.choice(HOSTILE_DIMS))
    elif kind == 4 and i < len(request.raw_input_contents):
        blob = request.raw_input_contents[i]
        request.raw_input_contents[i] = rng.choice([blob[:-1], blob + b"\xff", rng.randbytes(8)])
    elif kind == 5:
        field = rng.choice(list(ODD_VALUES))
        getattr(tensor.contents, field).append(rng.choice(ODD_VALUES[field]))
    elif kind == 6:
        request.inputs.append(tensor)
        if i < len(request.raw_input_contents):
            request.raw_input_contents.append(request.raw_input_contents[i])
    elif kind == 7:
        del request.inputs[i]
    elif kind == 8:
        request.raw_input_contents.append(b"extra")
    elif kind == 9:  # BYTES: a length prefix past the end, invalid UTF-8, an oversized element
        element = rng.choice([b"\xff\xfe", b"x" * (settings.SWITCHYARD_MAX_BYTES_ELEMENT + 1)])
        prefix = rng.choice([b"\xff\xff\xff\x7f", b"\x02\x00\x00\x00"])
        if i < len(request.raw_input_contents):
            request.raw_input_contents[i] = prefix + element
        else:
            tensor.contents.bytes_contents[:] = [element]


CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "UINT64": "uint64_contents"}
CONTENTS["FP32"] = "fp32_contents"
CONTENTS["BYTES"] = "bytes_contents"
TEXT = replace(
    route(("t", "BYTES", (-1,))),
    inputs=(InputSpec("t", "BYTES", OIP_TO_NUMPY["BYTES"], (-1,), text=True),),
)


def hostile(rng: random.Random, where: Route) -> pb.ModelInferRequest:
    request = valid(rng, where, use_raw=rng.random() < 0.5)
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        if request.inputs:
            mutate(rng, request)
    return request


@pytest.mark.parametrize(
    "where",
    [
        ROUTE,
        route(("x", "INT8", (-1, -1))),
        route(("x", "BOOL", (-1,)), ("z", "UINT64", (4,))),
        route(("b", "BYTES", (-1, 2)), ("x", "FP32", (-1, 4))),
        TEXT,
    ],
    ids=["fp32", "int8", "bool-and-uint64", "bytes-and-fp32", "text"],
)
def test_seeded_hostile_requests_parse_or_are_refused_with_400(where):
    rng = random.Random(20261126)
    parsed_ok = refused_count = 0
    for _ in range(3000):
        request = hostile(rng, where)
        try:
            parsed = parse_infer(request, where)
        except ApiError as exc:
            assert exc.status == 400, exc.message
            refused_count += 1
            continue
        parsed_ok += 1
        for tensor, name, array in zip(request.inputs, parsed.names, parsed.arrays, strict=True):
            spec = where.input(name)
            assert spec is not None and array.dtype == spec.dtype
            assert list(array.shape) == list(tensor.shape)
            if array.dtype.kind == "f":
                assert np.isfinite(array).all()
            if spec.datatype == "BYTES":
                values = array.ravel().tolist()
                assert all(isinstance(v, bytes) for v in values)
                assert all(len(v) <= settings.SWITCHYARD_MAX_BYTES_ELEMENT for v in values)
                if spec.text:
                    for v in values:
                        v.decode()
    # The generator reaches both sides, so the property says something.
    assert parsed_ok > 300 and refused_count > 1000
