"""Checks of request tensors against a version's signature, done before a request is queued.

Catching a bad request here answers it alone with ``bad_input`` instead of letting it reach
the model and fail the whole batch it was grouped into.
"""

from __future__ import annotations

import numpy as np

from ._exceptions import BadInput
from .protocol import OIP_TO_NUMPY, TensorSpec


def numpy_dtype(datatype: str) -> np.dtype:
    try:
        return OIP_TO_NUMPY[datatype]
    except KeyError:
        raise ValueError(f"unsupported datatype {datatype}") from None


def check_signature(specs: list[TensorSpec]) -> None:
    """Refuse, at load time, signatures the agent cannot batch."""
    for spec in specs:
        numpy_dtype(spec.datatype)
        if not spec.shape:
            raise ValueError(f"tensor {spec.name!r} has no batch dimension")


def check_inputs(specs: list[TensorSpec], inputs: dict[str, np.ndarray]) -> int:
    """Validate names, dtypes and shapes; returns the request's row count (its batch dim)."""
    expected = [s.name for s in specs]
    if sorted(inputs) != sorted(expected):
        raise BadInput(f"expected inputs {expected}, got {list(inputs)}")
    rows = -1
    for spec in specs:
        array = inputs[spec.name]
        dtype = numpy_dtype(spec.datatype)
        if array.dtype != dtype:
            raise BadInput(f"input {spec.name!r}: expected {spec.datatype}, got {array.dtype}")
        if array.ndim != len(spec.shape) or any(
            want not in (-1, got) for want, got in zip(spec.shape[1:], array.shape[1:], strict=True)
        ):
            raise BadInput(
                f"input {spec.name!r}: shape {list(array.shape)} does not fit {spec.shape}"
            )
        if rows not in (-1, array.shape[0]):
            raise BadInput("inputs disagree on the batch dimension")
        rows = array.shape[0]
    if rows < 1:
        raise BadInput("a request needs at least one row")
    return rows


def zeros_feed(specs: list[TensorSpec], rows: int) -> dict[str, np.ndarray]:
    """Zero tensors of ``rows`` rows (empty strings for BYTES); dynamic non-batch dims
    become 1."""
    feed = {}
    for s in specs:
        shape = [rows, *(d if d > 0 else 1 for d in s.shape[1:])]
        if s.datatype == "BYTES":
            feed[s.name] = np.full(shape, b"", dtype=object)
        else:
            feed[s.name] = np.zeros(shape, numpy_dtype(s.datatype))
    return feed
