"""Validation of OIP v2 inference bodies: each malformed class is a 400 naming the field."""

import json

import numpy as np
import pytest

from gateway.errors import ApiError
from gateway.oip_codec import parse_infer, render_infer
from gateway.routes import InputSpec, Route

ROUTE = Route(
    tenant_id=1,
    model_name="clf",
    version_id=9,
    model_id=2,
    version=3,
    task="classifier",
    inputs=(InputSpec("x", "FP32", np.dtype("<f4"), (-1, 4)),),
    outputs=({"name": "y", "datatype": "FP32", "shape": [-1, 2]},),
    feature_names=(),
)


def body(inputs, **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def good(data=None, shape=(2, 4)):
    return {
        "name": "x",
        "shape": list(shape),
        "datatype": "FP32",
        "data": data if data is not None else list(range(8)),
    }


def test_flat_and_nested_data_both_parse():
    flat = parse_infer(body([good()], id="r1"), None, ROUTE)
    nested = parse_infer(body([good([[0, 1, 2, 3], [4, 5, 6, 7]])]), None, ROUTE)
    assert flat.id == "r1"
    np.testing.assert_array_equal(flat.arrays[0], nested.arrays[0])
    assert flat.arrays[0].dtype == np.float32 and flat.arrays[0].shape == (2, 4)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (body([]), "inputs: must be a non-empty list"),
        (body([{**good(), "name": "z"}]), "unknown input 'z'"),
        (body([{**good(), "datatype": "INT64"}]), "expects FP32, got INT64"),
        (body([{**good(), "datatype": "STRING"}]), "unsupported datatype"),
        (body([good(list(range(7)))]), "holds 8 values but data has 7"),
        (body([good(list(range(6)), shape=(2, 3))]), "does not match the signature"),
        (body([good(shape=(8,))]), "does not match the signature"),
        (body([good(["a"] * 8)]), "data: not a list of numbers"),
        (body([good([[0, 1], [2, 3, 4]])]), "data: not a list of numbers"),
        (body([{**good(), "shape": [2, -4]}]), "shape: must be a list of non-negative"),
        (body([good([float("nan")] + list(range(7)))]), "NaN or infinity"),
        (body([good([float("inf")] + list(range(7)))]), "NaN or infinity"),
        (body([good(), good()]), "inputs[1] ('x').name: input 'x' given twice"),
        (body([good()], outputs=[{"name": "nope"}]), "unknown output 'nope'"),
        (body([good()], id=5), "id: must be a string"),
    ],
)
def test_malformed_requests_are_400_with_a_message_naming_the_problem(raw, message):
    with pytest.raises(ApiError) as err:
        parse_infer(raw, None, ROUTE)
    assert err.value.status == 400
    assert message in err.value.message


def test_missing_input_is_named():
    route = Route(
        **{
            **ROUTE.__dict__,
            "inputs": ROUTE.inputs + (InputSpec("mask", "BOOL", np.dtype("bool"), (-1,)),),
        }
    )
    with pytest.raises(ApiError, match="missing input 'mask'"):
        parse_infer(body([good()]), None, route)


def test_integer_inputs_refuse_fractions_and_out_of_range_values():
    route = Route(**{**ROUTE.__dict__, "inputs": (InputSpec("x", "INT8", np.dtype("i1"), (-1,)),)})
    with pytest.raises(ApiError, match="values must be INT8"):
        parse_infer(
            body([{"name": "x", "shape": [2], "datatype": "INT8", "data": [1.5, 2]}]), None, route
        )
    with pytest.raises(ApiError, match="out of range"):
        parse_infer(
            body([{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}]), None, route
        )


def test_binary_tensor_extension_round_trips():
    array = np.arange(8, dtype=np.float32).reshape(2, 4)
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [2, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 32},
                }
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    parsed = parse_infer(head + array.tobytes(), str(len(head)), ROUTE)
    np.testing.assert_array_equal(parsed.arrays[0], array)
    assert parsed.binary_outputs == {"y"}
    out = np.ones((2, 2), np.float32)
    payload, headers = render_infer(ROUTE, None, [("y", out)], parsed.binary_outputs)
    size = int(dict(headers)["inference-header-content-length"])
    doc = json.loads(payload[:size])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 16
    np.testing.assert_array_equal(np.frombuffer(payload[size:], np.float32).reshape(2, 2), out)


def test_binary_size_that_disagrees_with_the_shape_is_refused():
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [2, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                }
            ]
        }
    ).encode()
    with pytest.raises(ApiError, match="needs 32 bytes, got 16"):
        parse_infer(head + bytes(16), str(len(head)), ROUTE)


def test_json_response_follows_the_protocol():
    payload, headers = render_infer(ROUTE, "r1", [("y", np.zeros((1, 2), np.float32))], set())
    assert json.loads(payload) == {
        "model_name": "clf",
        "model_version": "3",
        "id": "r1",
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [0.0, 0.0]}],
    }
