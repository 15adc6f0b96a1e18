"""Per-request checks against a version's signature, done before a request is queued."""

from __future__ import annotations

import numpy as np
import pytest

from serving_agent import BadInput
from serving_agent._signature import check_inputs, check_signature, zeros_feed
from serving_agent.protocol import TensorSpec

SPECS = [
    TensorSpec(name="x", datatype="FP32", shape=[-1, 4]),
    TensorSpec(name="mask", datatype="INT64", shape=[-1, -1]),
]


def test_a_fitting_request_returns_its_row_count() -> None:
    inputs = {"x": np.zeros((3, 4), np.float32), "mask": np.zeros((3, 7), np.int64)}
    assert check_inputs(SPECS, inputs) == 3


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"x": np.zeros((1, 4), np.float32)}, "expected inputs"),
        (
            {"x": np.zeros((1, 4), np.float64), "mask": np.zeros((1, 2), np.int64)},
            "expected FP32",
        ),
        (
            {"x": np.zeros((1, 5), np.float32), "mask": np.zeros((1, 2), np.int64)},
            "does not fit",
        ),
        ({"x": np.zeros(4, np.float32), "mask": np.zeros((1, 2), np.int64)}, "does not fit"),
        (
            {"x": np.zeros((2, 4), np.float32), "mask": np.zeros((1, 2), np.int64)},
            "disagree",
        ),
        ({"x": np.zeros((0, 4), np.float32), "mask": np.zeros((0, 2), np.int64)}, "one row"),
    ],
)
def test_a_request_that_does_not_fit_is_bad_input(
    inputs: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(BadInput, match=message):
        check_inputs(SPECS, inputs)


def test_signatures_without_a_batch_dim_or_with_unknown_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="no batch dimension"):
        check_signature([TensorSpec(name="s", datatype="FP32", shape=[])])
    with pytest.raises(ValueError, match="unsupported datatype"):
        check_signature([TensorSpec(name="s", datatype="STRING", shape=[-1])])


def test_warm_up_feed_uses_one_for_dynamic_non_batch_dims() -> None:
    feed = zeros_feed(SPECS, 5)
    assert feed["x"].shape == (5, 4) and feed["x"].dtype == np.float32
    assert feed["mask"].shape == (5, 1) and feed["mask"].dtype == np.int64
