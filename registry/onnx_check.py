"""Check an uploaded ONNX file in a child process: ``python -m registry.onnx_check PATH``.

ONNX's parser holds the whole model in memory (its weights included) while it checks it. Run
here, that memory belongs to a short-lived process and goes with it, so an upload of hundreds of
megabytes does not grow the web server; and a file crafted to crash the C++ parser takes down
this child, not the server. Prints one JSON object: ``{"inputs": [...], "outputs": [...]}``,
each a base64 ``ValueInfoProto`` (read back by ``registry.signature``), and ``"labels"``: the
class labels of each output a ``ZipMap`` produces (``zipmap_labels``); or ``{"error": ...}``.
No Django here: the child starts in a fraction of a second.

``load_checked`` holds every check of an ONNX upload; small uploads, checked in the web
process (``registry.signature.read_onnx_signature``), go through it too.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

from .weights import non_finite, onnx_tensors, onnx_weights


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


def load_checked(source: str | bytes) -> Any:
    """The ``onnx.ModelProto`` at ``source`` (a path, or the file's bytes) once it passed every
    check of an upload; ``ValueError`` says which one failed."""
    import onnx

    try:
        if isinstance(source, str):
            model = onnx.load(source, load_external_data=False)
        else:
            model = onnx.load_model_from_string(source)
    except Exception as exc:  # onnx raises several unrelated types for a bad file
        raise ValueError(f"not a valid ONNX model: {exc}") from None
    # Before ONNX's checker, whose message for a location outside the model's folder misleads.
    refuse_external_data(model)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ValueError(f"not a valid ONNX model: {exc}") from None
    try:
        problem = non_finite(onnx_weights(model))
    except Exception as exc:  # a tensor whose data does not fit its type and shape
        raise ValueError(f"not a valid ONNX model: {exc}") from None
    if problem is not None:
        raise ValueError(problem)
    return model


def refuse_external_data(model: Any) -> None:
    """An upload is one ``.onnx`` file, so a tensor whose data lies in another file (ONNX's
    external data) names a file that is not part of the upload: on the agent, a file beside
    the cached artifact, or outside it (``../x``, an absolute path, a symlink). Such a version
    could never load, or would read a file it was never given: refused, whatever it names."""
    from onnx.external_data_helper import uses_external_data

    for tensor in onnx_tensors(model):
        if uses_external_data(tensor):
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            raise ValueError(
                f"tensor {tensor.name!r} keeps its data in an external file ({location!r}); an "
                "ONNX upload is one self-contained file: save the model with its weights inside "
                "it (onnx.save_model(model, path, save_as_external_data=False)) and upload that"
            )


def check(path: str) -> dict[str, object]:
    import onnx

    try:
        model = load_checked(path)
    except ValueError as exc:
        return {"error": str(exc)}
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
