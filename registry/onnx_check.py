"""Check an uploaded ONNX file in a child process: ``python -m registry.onnx_check PATH``.

ONNX's parser holds the whole model in memory (its weights included) while it checks it. Run
here, that memory belongs to a short-lived process and goes with it, so an upload of hundreds of
megabytes does not grow the web server; and a file crafted to crash the C++ parser takes down
this child, not the server. Prints one JSON object: ``{"inputs": [...], "outputs": [...]}``,
each a base64 ``ValueInfoProto`` (read back by ``registry.signature``), and ``"labels"``: the
class labels of each output a ``ZipMap`` produces (``zipmap_labels``); or ``{"error": ...}``.
No Django here: the child starts in a fraction of a second.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any


def zipmap_labels(graph: Any) -> dict[str, list[int] | list[str]]:
    """{output name: class labels} for each ``ZipMap`` node of an ``onnx.GraphProto``.

    The classifier converters (skl2onnx, onnxmltools) end in a ZipMap that turns the
    probability matrix into one {label: probability} map per row; its attribute lists the
    labels in column order, which is the order the agent returns the matrix in.
    """
    found: dict[str, list[int] | list[str]] = {}
    for node in graph.node:
        if node.op_type != "ZipMap" or node.domain != "ai.onnx.ml":
            continue
        for attribute in node.attribute:
            if attribute.name == "classlabels_int64s":
                found[node.output[0]] = [int(v) for v in attribute.ints]
            elif attribute.name == "classlabels_strings":
                found[node.output[0]] = [v.decode("utf-8", "replace") for v in attribute.strings]
    return found


def check(path: str) -> dict[str, object]:
    import onnx

    try:
        model = onnx.load(path, load_external_data=False)
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx raises several unrelated types for a bad file
        return {"error": f"not a valid ONNX model: {exc}"}
    initializers = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]

    def encoded(values: list[onnx.ValueInfoProto]) -> list[str]:
        return [base64.b64encode(v.SerializeToString()).decode() for v in values]

    return {
        "inputs": encoded(inputs),
        "outputs": encoded(list(model.graph.output)),
        "labels": zipmap_labels(model.graph),
    }


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1])))
