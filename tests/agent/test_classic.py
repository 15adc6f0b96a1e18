"""Classic ML on the agent: a converted classifier's ZipMap output (one {label: probability}
dict per row from ONNX Runtime) comes back as a probability matrix in the label order read
at upload, equal to the library's own predict_proba; NaN goes through to the trees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from registry.signature import read_onnx_signature
from serving_agent import OnnxRuntime, load_runtime, warm_up
from serving_agent._classic import as_matrices, class_labels, probability_matrix
from serving_agent.protocol import TensorSpec, VersionSpec
from tests import classic_models
from tests.classic_models import Trained

TOLERANCE = 1e-5


def spec_of(trained: Trained) -> VersionSpec:
    """The spec the platform sends for this artifact: its signature as the registry reads it."""
    inputs, outputs = read_onnx_signature(trained.onnx)
    return VersionSpec(
        version_id=1,
        model=trained.name,
        version=1,
        sha256="0" * 64,
        artifact_url="/",
        inputs=[TensorSpec(**t) for t in inputs],
        outputs=[TensorSpec(**t) for t in outputs],
        max_batch_size=16,
        device="cpu",
    )


def saved(trained: Trained, tmp_path: Path) -> Path:
    path = tmp_path / f"{trained.name}.onnx"
    path.write_bytes(trained.onnx)
    return path


def test_maps_become_a_matrix_in_the_order_of_the_labels():
    maps = [{0: 0.25, 1: 0.75, 2: 0.0}, {0: 0.5, 1: 0.125, 2: 0.375}]
    matrix = probability_matrix(maps, [2, 0, 1])
    assert matrix.dtype == np.float32
    np.testing.assert_array_equal(matrix, [[0.0, 0.25, 0.75], [0.375, 0.5, 0.125]])


def test_string_labels_index_the_maps_too():
    maps = [{"cat": 0.75, "dog": 0.25}]
    np.testing.assert_array_equal(probability_matrix(maps, ["dog", "cat"]), [[0.25, 0.75]])


def test_no_rows_is_an_empty_matrix_of_the_right_width():
    assert probability_matrix([], [0, 1, 2]).shape == (0, 3)


def test_a_label_the_maps_lack_is_a_clear_error():
    with pytest.raises(RuntimeError, match="class labels \\[0, 1, 5\\]"):
        probability_matrix([{0: 0.5, 1: 0.5}], [0, 1, 5])


def test_only_outputs_with_labels_are_converted():
    labels = class_labels(
        [
            TensorSpec(name="label", datatype="INT64", shape=[-1]),
            TensorSpec(name="probs", datatype="FP32", shape=[-1, 2], parameters={"labels": [0, 1]}),
        ]
    )
    assert labels == {"probs": [0, 1]}
    label = np.array([1], np.int64)
    out = as_matrices(["label", "probs"], [label, [{0: 0.2, 1: 0.8}]], labels)
    assert out[0] is label
    np.testing.assert_allclose(out[1], [[0.2, 0.8]])


@pytest.mark.parametrize(
    "train",
    [
        classic_models.logistic_regression,
        classic_models.random_forest,
        classic_models.gradient_boosting,
        classic_models.scaled_pipeline,
        classic_models.xgboost_classifier,
        classic_models.lightgbm_classifier,
    ],
)
def test_converted_classifiers_match_their_library(train, tmp_path):
    trained = train()
    spec = spec_of(trained)
    runtime = load_runtime(saved(trained, tmp_path), spec)
    warm_up(runtime, spec, timed_runs=1)  # outputs of one row per input row, batch 1 and 16
    label, probabilities = runtime.run({trained.input_name: trained.x})
    np.testing.assert_array_equal(label.ravel(), trained.model.predict(trained.x))
    assert probabilities.dtype == np.float32 and probabilities.shape == (len(trained.x), 3)
    np.testing.assert_allclose(
        probabilities, trained.model.predict_proba(trained.x), rtol=TOLERANCE, atol=TOLERANCE
    )


def test_string_labels_come_back_as_strings_with_their_probabilities(tmp_path):
    # The label output is BYTES in the signature; here the runtime alone (the wire is the
    # BYTES tensor support's).
    trained = classic_models.random_forest(labels=["cat", "dog", "emu"])
    spec = spec_of(trained)
    runtime = OnnxRuntime(saved(trained, tmp_path), "cpu", 1, class_labels(spec.outputs))
    label, probabilities = runtime.run({"X": trained.x})
    assert label.dtype == object
    assert label.tolist() == trained.model.predict(trained.x).tolist()
    np.testing.assert_allclose(
        probabilities, trained.model.predict_proba(trained.x), rtol=TOLERANCE, atol=TOLERANCE
    )


@pytest.mark.parametrize(
    "train", [classic_models.xgboost_classifier, classic_models.lightgbm_classifier]
)
def test_nan_reaches_the_trees_as_a_missing_value(train, tmp_path):
    trained = train(missing=True)
    assert np.isnan(trained.x).any()
    runtime = load_runtime(saved(trained, tmp_path), spec_of(trained))
    label, probabilities = runtime.run({"input": trained.x})
    np.testing.assert_array_equal(label.ravel(), trained.model.predict(trained.x))
    np.testing.assert_allclose(
        probabilities, trained.model.predict_proba(trained.x), rtol=TOLERANCE, atol=TOLERANCE
    )


def test_a_regressor_matches_its_library(tmp_path):
    trained = classic_models.ridge_regressor()
    runtime = load_runtime(saved(trained, tmp_path), spec_of(trained))
    (y,) = runtime.run({"X": trained.x})
    expected = trained.model.predict(trained.x)
    # The graph computes in float32: an output near zero carries the rounding of terms as large
    # as the largest output (1 part in 10^7 of ~350), so the bound is relative to that scale.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(y.ravel(), expected, rtol=TOLERANCE, atol=TOLERANCE * scale)
