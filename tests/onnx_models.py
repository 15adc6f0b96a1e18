"""Small ONNX models made with torch for tests (no Django here, so any process can import it)."""

from __future__ import annotations

import io
import warnings


def _export(model, n_in: int) -> bytes:
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter warns it is legacy; it is exact
        torch.onnx.export(
            model.eval(),
            (torch.zeros(1, n_in),),
            buffer,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
        )
    return buffer.getvalue()


def small_onnx(n_in: int = 4, n_out: int = 2, seed: int = 0) -> bytes:
    """A tiny MLP (4 → 8 → 2) with a dynamic batch dimension."""
    import torch

    torch.manual_seed(seed)
    return _export(
        torch.nn.Sequential(torch.nn.Linear(n_in, 8), torch.nn.ReLU(), torch.nn.Linear(8, n_out)),
        n_in,
    )


def slow_onnx(width: int = 1024, depth: int = 24) -> bytes:
    """A model slow enough (tens of ms per batch) that a request is surely in flight."""
    import torch

    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return _export(
        torch.nn.Sequential(torch.nn.Linear(4, width), *layers, torch.nn.Linear(width, 2)), 4
    )
