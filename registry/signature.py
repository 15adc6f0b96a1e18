"""Reading and checking the input/output signature of an ONNX artifact."""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
from typing import Any

import numpy as np
import onnx
from django.conf import settings
from onnx import TensorProto

from platform_site.errors import Invalid
from serving_agent.protocol import OIP_TO_NUMPY

from .onnx_check import load_checked, zipmap_labels

# ONNX element types that map onto Open Inference Protocol v2 datatypes.
_ONNX_TO_OIP = {
    TensorProto.BOOL: "BOOL",
    TensorProto.UINT8: "UINT8",
    TensorProto.UINT16: "UINT16",
    TensorProto.UINT32: "UINT32",
    TensorProto.UINT64: "UINT64",
    TensorProto.INT8: "INT8",
    TensorProto.INT16: "INT16",
    TensorProto.INT32: "INT32",
    TensorProto.INT64: "INT64",
    TensorProto.FLOAT16: "FP16",
    TensorProto.FLOAT: "FP32",
    TensorProto.DOUBLE: "FP64",
    # ONNX string tensors (text inputs, class labels) are OIP's BYTES: UTF-8 on the wire.
    TensorProto.STRING: "BYTES",
}


class SignatureError(Invalid):
    """The artifact or the declared signature is not acceptable; the message names the field."""


def _tensors(
    values: Any, kind: str, labels: dict[str, list[Any]] | None = None
) -> list[dict[str, Any]]:
    out = []
    for value in values:
        if value.type.HasField("sequence_type") and labels is not None:
            out.append(_class_probabilities(value, labels))
            continue
        tensor_type = value.type.tensor_type
        datatype = _ONNX_TO_OIP.get(tensor_type.elem_type)
        if datatype is None:
            raise SignatureError(
                "artifact", f"{kind} {value.name!r} has an element type Switchyard cannot serve"
            )
        shape = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim]
        out.append({"name": value.name, "datatype": datatype, "shape": shape})
    if labels:
        # A classifier's outputs have one row per input row, whatever the converter wrote
        # (onnxmltools declares LightGBM's label output as [1]).
        for tensor in out:
            if tensor["shape"]:
                tensor["shape"][0] = -1
    return out


def _class_probabilities(value: Any, labels: dict[str, list[Any]]) -> dict[str, Any]:
    """The signature of a classifier's ZipMap output (one {label: probability} map per row):
    the agent returns it as an FP32 [rows, classes] matrix, its columns in the order of the
    labels recorded in the output's ``parameters``."""
    element = value.type.sequence_type.elem_type
    is_map = element.HasField("map_type")
    key = element.map_type.key_type
    if (
        not is_map
        or key not in (TensorProto.INT64, TensorProto.STRING)
        or element.map_type.value_type.tensor_type.elem_type != TensorProto.FLOAT
        or value.name not in labels
        or not labels[value.name]
    ):
        raise SignatureError(
            "artifact",
            f"output {value.name!r} is a sequence Switchyard cannot serve: only a ZipMap's "
            "maps of class label to probability are read (or convert with zipmap=False)",
        )
    classes = labels[value.name]
    return {
        "name": value.name,
        "datatype": "FP32",
        "shape": [-1, len(classes)],
        "parameters": {"labels": classes},
    }


# How long the child process that checks a large ONNX upload may take.
CHILD_CHECK_TIMEOUT_S = 300


def read_onnx_signature_from_file(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The (inputs, outputs) of the ONNX model at ``path``, checked in a child process
    (``registry.onnx_check``): the model's weights are never loaded into this process."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "registry.onnx_check", path],
            cwd=settings.BASE_DIR,
            capture_output=True,
            timeout=CHILD_CHECK_TIMEOUT_S,
            check=False,
        )
        answer = json.loads(done.stdout)
    except subprocess.TimeoutExpired:
        raise SignatureError("artifact", "checking the ONNX model took too long") from None
    except ValueError:  # the child died (a crafted file can crash ONNX's parser)
        raise SignatureError("artifact", "not a valid ONNX model: the checker failed") from None
    if "error" in answer:
        raise SignatureError("artifact", answer["error"])

    def decoded(values: list[str]) -> list[onnx.ValueInfoProto]:
        return [onnx.ValueInfoProto.FromString(base64.b64decode(v)) for v in values]

    return (
        _tensors(decoded(answer["inputs"]), "input"),
        _tensors(decoded(answer["outputs"]), "output", answer["labels"]),
    )


def read_onnx_signature(data: bytes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The (inputs, outputs) of an ONNX model, after the checks of an upload (``load_checked``)."""
    try:
        model = load_checked(data)
    except ValueError as exc:
        raise SignatureError("artifact", str(exc)) from None
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in initializers]
    outputs = _tensors(model.graph.output, "output", zipmap_labels(model.graph))
    return _tensors(graph_inputs, "input"), outputs


def normalize_declared(declared: Any, field: str) -> list[dict[str, Any]]:
    """Check the shape of a declared signature: a list of {name, datatype, shape}."""
    if not isinstance(declared, list) or not declared:
        raise SignatureError(field, "must be a non-empty list of {name, datatype, shape}")
    out = []
    for i, t in enumerate(declared):
        where = f"{field}[{i}]"
        if not isinstance(t, dict) or set(t) - {"name", "datatype", "shape"}:
            raise SignatureError(where, "must be an object with name, datatype and shape")
        name, datatype, shape = t.get("name"), t.get("datatype"), t.get("shape")
        if not isinstance(name, str) or not name:
            raise SignatureError(f"{where}.name", "must be a non-empty string")
        if datatype not in OIP_TO_NUMPY:
            raise SignatureError(
                f"{where}.datatype", f"must be one of {', '.join(OIP_TO_NUMPY)}; got {datatype!r}"
            )
        valid_dims = isinstance(shape, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in shape
        )
        if not valid_dims:
            raise SignatureError(f"{where}.shape", "must be a list of integers, -1 for dynamic")
        out.append({"name": name, "datatype": datatype, "shape": shape})
    return out


def with_artifact_parameters(
    declared: list[dict[str, Any]], actual: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A declared signature keeps what only the artifact knows (a classifier's labels)."""
    parameters = {t["name"]: t["parameters"] for t in actual if "parameters" in t}
    return [
        {**t, "parameters": parameters[t["name"]]} if t["name"] in parameters else t
        for t in declared
    ]


def check_declared_matches(
    declared: list[dict[str, Any]], actual: list[dict[str, Any]], field: str
) -> None:
    """Refuse a declared signature that disagrees with the artifact's own."""
    by_name = {t["name"]: t for t in actual}
    declared_names = [t["name"] for t in declared]
    if sorted(declared_names) != sorted(by_name):
        raise SignatureError(
            field,
            f"declares {declared_names} but the artifact has {[t['name'] for t in actual]}",
        )
    for t in declared:
        real = by_name[t["name"]]
        if t["datatype"] != real["datatype"]:
            raise SignatureError(
                field,
                f"{t['name']!r} is declared {t['datatype']} "
                f"but the artifact has {real['datatype']}",
            )
        dims_agree = len(t["shape"]) == len(real["shape"]) and all(
            d == r or r == -1 for d, r in zip(t["shape"], real["shape"], strict=True)
        )
        if not dims_agree:
            raise SignatureError(
                field,
                f"{t['name']!r} is declared with shape {t['shape']} "
                f"but the artifact has {real['shape']}",
            )


MAX_DEFAULT_VALUES = 4096  # a default answer is a small constant, not a dataset


def check_default_answer(answer: Any) -> list[tuple[str, np.ndarray]]:
    """A model's default answer (OIP v2 output tensors ``[{name, datatype, shape, data}]``,
    ``data`` flat in row-major order) as (name, array) pairs; refuses anything else."""
    field = "default_answer"
    if not isinstance(answer, list) or not answer:
        raise SignatureError(field, "must be a non-empty list of {name, datatype, shape, data}")
    out: list[tuple[str, np.ndarray]] = []
    for i, t in enumerate(answer):
        where = f"{field}[{i}]"
        if not isinstance(t, dict) or set(t) != {"name", "datatype", "shape", "data"}:
            raise SignatureError(where, "must be an object with name, datatype, shape and data")
        name, datatype, shape, data = t["name"], t["datatype"], t["shape"], t["data"]
        if not isinstance(name, str) or not name or name in {n for n, _ in out}:
            raise SignatureError(f"{where}.name", "must be a non-empty string, given once")
        if datatype not in OIP_TO_NUMPY or datatype == "BYTES":
            raise SignatureError(
                f"{where}.datatype", f"must be a numeric OIP datatype; got {datatype!r}"
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DEFAULT_VALUES
            for d in shape
        ):
            raise SignatureError(f"{where}.shape", "must be a list of non-negative integers")
        size = math.prod(shape)
        if size > MAX_DEFAULT_VALUES:
            raise SignatureError(f"{where}.shape", f"at most {MAX_DEFAULT_VALUES} values")
        if not isinstance(data, list) or len(data) != size:
            raise SignatureError(f"{where}.data", f"must be a flat list of {size} values")
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in data):
            raise SignatureError(f"{where}.data", "must hold finite numbers only")
        try:
            array = np.array(data, dtype=OIP_TO_NUMPY[datatype]).reshape(shape)
        except (OverflowError, ValueError) as exc:
            raise SignatureError(f"{where}.data", f"does not fit {datatype}: {exc}") from None
        out.append((name, array))
    return out
