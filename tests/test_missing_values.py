"""NaN as a missing value: a version uploaded with allow_missing=true takes NaN (and only NaN:
infinity stays refused) in its float inputs on every front door (OIP JSON as a NaN literal, a
"NaN" string or null; the binary extension; gRPC; the prediction API's null for a missing
feature); without it NaN stays a 400 that says how to allow it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from gateway import grpc_codec, oip_codec
from gateway.errors import ApiError
from gateway.predict_codec import arrays_from_predict_body
from gateway.predlog import input_columns
from gateway.proto import grpc_predict_v2_pb2 as pb
from gateway.routes import InputSpec, Route

STRICT = Route(
    tenant_id=1,
    model_name="trees",
    version_id=9,
    model_id=2,
    version=1,
    task="classifier",
    inputs=(InputSpec("x", "FP32", np.dtype("<f4"), (-1, 3)),),
    outputs=({"name": "label", "datatype": "INT64", "shape": [-1]},),
    feature_names=("age", "income", "tenure"),
)
MISSING = replace(STRICT, inputs=(replace(STRICT.inputs[0], allow_missing=True),))
ROW = [41.0, math.nan, 3.0]


def oip_json(values: list, route: Route) -> np.ndarray:
    # json.dumps writes NaN as the literal NaN, as tritonclient's JSON does.
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": values}]}
    return oip_codec.parse_infer(json.dumps(doc).encode(), None, route).arrays[0]


def oip_binary(row: list[float], route: Route) -> np.ndarray:
    blob = np.array([row], np.float32).tobytes()
    head = {
        "inputs": [
            {
                "name": "x",
                "datatype": "FP32",
                "shape": [1, 3],
                "parameters": {"binary_data_size": len(blob)},
            }
        ]
    }
    header = json.dumps(head).encode()
    return oip_codec.parse_infer(header + blob, str(len(header)), route).arrays[0]


def grpc(row: list[float], route: Route, raw: bool) -> np.ndarray:
    request = pb.ModelInferRequest(model_name="trees")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 3])
    if raw:
        request.raw_input_contents.append(np.array([row], np.float32).tobytes())
    else:
        tensor.contents.fp32_contents.extend(row)
    return grpc_codec.parse_infer(request, route).arrays[0]


def predict(row: dict, route: Route) -> np.ndarray:
    return arrays_from_predict_body({"instances": [row]}, route)[1][0]


DOORS = {
    "oip-json-literal": lambda route: oip_json(ROW, route),
    "oip-json-string": lambda route: oip_json([41.0, "NaN", 3.0], route),
    "oip-json-null": lambda route: oip_json([41.0, None, 3.0], route),
    "oip-binary": lambda route: oip_binary(ROW, route),
    "grpc-typed": lambda route: grpc(ROW, route, raw=False),
    "grpc-raw": lambda route: grpc(ROW, route, raw=True),
    "predict-null-feature": lambda route: predict({"age": 41, "income": None, "tenure": 3}, route),
}


@pytest.mark.parametrize("door", DOORS)
def test_nan_is_a_missing_value_where_the_version_allows_it(door):
    array = DOORS[door](MISSING)
    assert array.dtype == np.float32 and array.shape == (1, 3)
    np.testing.assert_array_equal(array, [[41.0, np.nan, 3.0]])


@pytest.mark.parametrize("door", DOORS)
def test_nan_is_refused_without_allow_missing_and_says_how(door):
    with pytest.raises(ApiError) as caught:
        DOORS[door](STRICT)
    assert caught.value.status == 400
    assert "NaN or infinity" in caught.value.message
    assert "allow_missing=true" in caught.value.message


INFINITE = {
    "oip-json": lambda route: oip_json([41.0, "Infinity", 3.0], route),
    "oip-binary": lambda route: oip_binary([41.0, -math.inf, 3.0], route),
    "grpc": lambda route: grpc([math.inf, 1.0, 3.0], route, raw=True),
    "predict": lambda route: predict({"age": 1e400, "income": 1.0, "tenure": 3}, route),
}


@pytest.mark.parametrize("door", INFINITE)
def test_infinity_stays_refused_even_where_nan_is_allowed(door):
    with pytest.raises(ApiError) as caught:
        INFINITE[door](MISSING)
    assert caught.value.status == 400
    assert "infinity (only NaN marks a missing value)" in caught.value.message


def test_a_logged_missing_value_is_null_by_feature_name():
    # Prediction logs and drift read null as missing, as a reference sample writes it.
    columns = input_columns(MISSING, ["x"], [np.array([ROW], np.float32)], b"key")
    assert columns == {"age": [41.0], "income": [None], "tenure": [3.0]}
