"""Classic ML classifiers converted to ONNX (skl2onnx, onnxmltools): their probabilities come
out of ONNX Runtime as one {class label: probability} dict per row (the converters' ZipMap);
the agent turns them back into an FP32 [rows, classes] matrix, columns in the label order the
registry read from the artifact at upload (the output's ``parameters.labels``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .protocol import TensorSpec

Labels = list[int] | list[str]


def class_labels(outputs: list[TensorSpec]) -> dict[str, Labels]:
    """{output name: class labels} for the outputs that come out as ZipMap dicts."""
    return {
        o.name: o.parameters.labels
        for o in outputs
        if o.parameters is not None and o.parameters.labels
    }


def probability_matrix(maps: Sequence[dict[Any, Any]] | np.ndarray, labels: Labels) -> np.ndarray:
    """One row per map, one column per label, in ``labels`` order."""
    if isinstance(maps, np.ndarray):  # already a matrix: nothing to convert
        return maps
    try:
        rows = [[row[label] for label in labels] for row in maps]
    except (KeyError, TypeError) as exc:
        # The labels were read from this artifact at upload, so a mismatch is a broken
        # artifact or a converter we do not know; warm-up finds it before the version is ready.
        raise RuntimeError(
            f"the model's probabilities do not have the class labels {labels} "
            f"read at upload (missing {exc})"
        ) from None
    return np.array(rows, dtype=np.float32).reshape(len(rows), len(labels))


def as_matrices(
    names: list[str], outputs: list[Any], labels: dict[str, Labels]
) -> list[np.ndarray]:
    """ONNX Runtime's outputs (in ``names`` order) with each ZipMap output as its matrix."""
    return [
        probability_matrix(out, labels[name]) if name in labels else out
        for name, out in zip(names, outputs, strict=True)
    ]
