"""Small ONNX models made with torch for tests (no Django here, so any process can import it)."""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _export(model: torch.nn.Module, n_in: int) -> bytes:
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter warns it is legacy; it is exact
        torch.onnx.export(
            model.eval(),
            (torch.zeros(1, n_in),),
            buffer,  # type: ignore[arg-type]  # a file object works, as its docs say
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
    """A model slow enough (about 1 ms per row per 4 layers here) that a request is surely in
    flight; one hidden layer reused ``depth`` times keeps the file small (~4 MB)."""
    import torch

    class Slow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(4, width)
            self.hidden = torch.nn.Linear(width, width)
            self.out = torch.nn.Linear(width, 2)

        def forward(self, x: Any) -> Any:
            h = self.inp(x)
            for _ in range(depth):
                h = torch.tanh(self.hidden(h))
            return self.out(h)

    return _export(Slow(), 4)


def poisoned_onnx(threshold: float = 100.0) -> bytes:
    """A 4 → 2 model that fails at run time (ONNX Runtime raises) on any batch holding a value
    over ``threshold``, and answers otherwise: a version that errors on every request of a
    client sending such rows, while the agent's warm-up (zeros) passes. It reshapes its input
    to rows of ``4 + (max(x) > threshold)`` values, which 4 values a row cannot fill."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0),
        helper.make_node("Greater", ["peak", "threshold"], ["poisoned"]),
        helper.make_node("Cast", ["poisoned"], ["extra"], to=TensorProto.INT64),
        helper.make_node("Add", ["four", "extra"], ["width"]),
        helper.make_node("Unsqueeze", ["width", "zero_axis"], ["width_1d"]),
        helper.make_node("Concat", ["minus_one", "width_1d"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["rows"]),
        helper.make_node("MatMul", ["rows", "weights"], ["y"]),
    ]
    initializers = [
        helper.make_tensor("threshold", TensorProto.FLOAT, [], [threshold]),
        helper.make_tensor("four", TensorProto.INT64, [], [4]),
        helper.make_tensor("zero_axis", TensorProto.INT64, [1], [0]),
        helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("weights", TensorProto.FLOAT, [4, 2], [0.1 * i for i in range(8)]),
    ]
    graph = helper.make_graph(
        nodes,
        "poisoned",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def padded_onnx(megabytes: int) -> bytes:
    """A valid ONNX model (y = x, x of shape [batch, 4]) carrying ``megabytes`` MB of weights
    in an initializer it does not use: as large as a real model, made in a moment."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(
        np.ones(megabytes * 1024 * 1024 // 4, dtype=np.float32), name="padding"
    )
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "padded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def echo_onnx() -> bytes:
    """A graph with string tensors: ``t`` (STRING [-1]) is answered unchanged as ``u``: BYTES
    in and out, as a text classifier's labels are."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["t"], ["u"])],
        "echo",
        [helper.make_tensor_value_info("t", TensorProto.STRING, ["batch"])],
        [helper.make_tensor_value_info("u", TensorProto.STRING, ["batch"])],
    )
    # IR 8: what the installed ONNX Runtime reads (the onnx package writes a newer one).
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()
