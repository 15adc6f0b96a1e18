"""Check an uploaded ONNX file in a child process: ``python -m registry.onnx_check PATH``.

ONNX's parser holds the whole model in memory (its weights included) while it checks it. Run
here, that memory belongs to a short-lived process and goes with it, so an upload of hundreds of
megabytes does not grow the web server; and a file crafted to crash the C++ parser takes down
this child, not the server. Prints one JSON object: ``{"inputs": [...], "outputs": [...]}``,
each a base64 ``ValueInfoProto`` (read back by ``registry.signature``), or ``{"error": ...}``.
No Django here: the child starts in a fraction of a second.
"""

from __future__ import annotations

import base64
import json
import sys


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

    return {"inputs": encoded(inputs), "outputs": encoded(list(model.graph.output))}


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1])))
