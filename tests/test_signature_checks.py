import pytest

from registry.signature import (
    SignatureError,
    check_declared_matches,
    normalize_declared,
    read_onnx_signature,
)


def test_reads_names_datatypes_and_dynamic_dims(onnx_bytes):
    inputs, outputs = read_onnx_signature(onnx_bytes)
    assert inputs == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert outputs == [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]


def test_garbage_is_not_an_onnx_model():
    with pytest.raises(SignatureError, match="not a valid ONNX model") as err:
        read_onnx_signature(b"definitely not onnx")
    assert err.value.field == "artifact"


@pytest.mark.parametrize(
    "declared, message",
    [
        ([{"name": "z", "datatype": "FP32", "shape": [-1, 4]}], "declares"),
        ([{"name": "x", "datatype": "INT64", "shape": [-1, 4]}], "declared INT64"),
        ([{"name": "x", "datatype": "FP32", "shape": [-1, 5]}], "declared with shape"),
        ([{"name": "x", "datatype": "FP32", "shape": [-1]}], "declared with shape"),
    ],
)
def test_declared_signature_must_match_the_artifact(onnx_bytes, declared, message):
    inputs, _ = read_onnx_signature(onnx_bytes)
    with pytest.raises(SignatureError, match=message):
        check_declared_matches(normalize_declared(declared, "inputs"), inputs, "inputs")


def test_declared_may_fix_a_dynamic_dimension(onnx_bytes):
    inputs, _ = read_onnx_signature(onnx_bytes)
    declared = normalize_declared([{"name": "x", "datatype": "FP32", "shape": [8, 4]}], "inputs")
    check_declared_matches(declared, inputs, "inputs")


@pytest.mark.parametrize(
    "declared, field",
    [
        ("nope", "inputs"),
        ([{"name": "", "datatype": "FP32", "shape": [1]}], "inputs[0].name"),
        ([{"name": "x", "datatype": "FLOAT", "shape": [1]}], "inputs[0].datatype"),
        ([{"name": "x", "datatype": "FP32", "shape": [1.5]}], "inputs[0].shape"),
    ],
)
def test_malformed_declarations_name_the_field(declared, field):
    with pytest.raises(SignatureError) as err:
        normalize_declared(declared, "inputs")
    assert err.value.field == field
