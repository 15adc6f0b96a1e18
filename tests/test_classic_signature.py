"""Reading a converted classifier's signature at upload: the converters' ZipMap output (one
{label: probability} map per row) becomes an FP32 [-1, classes] matrix with the class labels
read from the graph; anything else that is not a tensor stays refused."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from registry.signature import (
    SignatureError,
    read_onnx_signature,
    read_onnx_signature_from_file,
    with_artifact_parameters,
)
from tests import classic_models


def test_a_scikit_learn_classifier_gives_labels_and_a_probability_matrix():
    trained = classic_models.logistic_regression()
    inputs, outputs = read_onnx_signature(trained.onnx)
    assert inputs == [{"name": "X", "datatype": "FP32", "shape": [-1, 6]}]
    assert outputs == [
        {"name": "output_label", "datatype": "INT64", "shape": [-1]},
        {
            "name": "output_probability",
            "datatype": "FP32",
            "shape": [-1, 3],
            "parameters": {"labels": trained.model.classes_.tolist()},
        },
    ]


def test_string_class_labels_give_a_bytes_label_output():
    trained = classic_models.random_forest(labels=["setosa", "versicolor", "virginica"])
    _, outputs = read_onnx_signature(trained.onnx)
    assert outputs[0] == {"name": "output_label", "datatype": "BYTES", "shape": [-1]}
    assert outputs[1]["parameters"] == {"labels": ["setosa", "versicolor", "virginica"]}


def test_the_child_process_check_reads_the_same_labels(tmp_path):
    # Uploads past the in-memory size are checked in a child process: same answer.
    trained = classic_models.lightgbm_classifier()
    path = tmp_path / "lgbm.onnx"
    path.write_bytes(trained.onnx)
    assert read_onnx_signature_from_file(str(path)) == read_onnx_signature(trained.onnx)


def test_lightgbm_label_output_gets_a_dynamic_batch_dimension():
    # onnxmltools declares LightGBM's label as shape [1]; it has one row per input row.
    _, outputs = read_onnx_signature(classic_models.lightgbm_classifier().onnx)
    assert outputs == [
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {
            "name": "probabilities",
            "datatype": "FP32",
            "shape": [-1, 3],
            "parameters": {"labels": [0, 1, 2]},
        },
    ]


def test_xgboost_probabilities_are_already_a_matrix():
    _, outputs = read_onnx_signature(classic_models.xgboost_classifier().onnx)
    assert outputs == [
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]},
    ]


def test_a_regressor_reads_as_before():
    inputs, outputs = read_onnx_signature(classic_models.ridge_regressor().onnx)
    assert inputs == [{"name": "X", "datatype": "FP32", "shape": [-1, 6]}]
    assert outputs == [{"name": "variable", "datatype": "FP32", "shape": [-1, 1]}]


def _sequence_model() -> bytes:
    """A graph whose output is a sequence of tensors, not a ZipMap's maps."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])
    y = helper.make_tensor_sequence_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("SequenceConstruct", ["x"], ["y"])
    graph = helper.make_graph([node], "seq", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_sequence_output_that_is_not_a_zipmap_is_refused_naming_it():
    with pytest.raises(SignatureError, match="output 'y' is a sequence") as err:
        read_onnx_signature(_sequence_model())
    assert err.value.field == "artifact"


def test_a_string_graph_reads_as_bytes_in_and_out():
    x = helper.make_tensor_value_info("x", TensorProto.STRING, [None])
    y = helper.make_tensor_value_info("y", TensorProto.STRING, [None])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "s", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs, outputs = read_onnx_signature(model.SerializeToString())
    assert inputs == [{"name": "x", "datatype": "BYTES", "shape": [-1]}]
    assert outputs == [{"name": "y", "datatype": "BYTES", "shape": [-1]}]


def test_a_declared_signature_keeps_the_labels_read_from_the_artifact():
    _, actual = read_onnx_signature(classic_models.gradient_boosting().onnx)
    declared = [{k: v for k, v in t.items() if k != "parameters"} for t in actual]
    assert with_artifact_parameters(declared, actual) == actual


def test_zipmap_labels_come_from_the_graph_not_from_sorting():
    # A ZipMap whose labels are not in sorted order: the recorded order is the graph's.
    model = onnx.load_model_from_string(classic_models.logistic_regression().onnx)
    zipmap = next(n for n in model.graph.node if n.op_type == "ZipMap")
    for attribute in zipmap.attribute:
        if attribute.name == "classlabels_int64s":
            del attribute.ints[:]
            attribute.ints.extend([7, 3, 5])
    _, outputs = read_onnx_signature(model.SerializeToString())
    assert outputs[1]["parameters"] == {"labels": [7, 3, 5]}
