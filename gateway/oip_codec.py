"""Parsing and rendering Open Inference Protocol v2 inference bodies.

Supports the JSON form and Triton's binary tensor extension (``Inference-Header-Content-Length``
with ``binary_data_size`` / ``binary_data`` parameters), which tritonclient uses by default.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson

from serving_agent.protocol import NUMPY_TO_OIP

from . import bytes_tensors
from .checks import check_complete, check_input, check_tensor
from .errors import ApiError, ascii_int, shown
from .parsed import ParsedInfer
from .routes import Route


def _load_json(raw: bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        refused = exc
    # orjson refuses NaN/Infinity literals and numbers past a double (1e400); the stdlib reads
    # them (as NaN and inf), so the tensor check can name the field that holds them. What else
    # orjson refused stays refused: nesting past its depth limit (the stdlib's parser would
    # recurse until RecursionError) and lone surrogates (the stdlib takes them, but no reply
    # or log can write them back), which writing the document again finds.
    try:
        doc = json.loads(raw)
        orjson.dumps(doc)
    except (ValueError, RecursionError, orjson.JSONEncodeError):
        raise ApiError(400, f"request body is not valid JSON: {refused}") from None
    return doc


def parse_infer(body: bytes, header_length: str | None, route: Route) -> ParsedInfer:
    binary = b""
    if header_length is not None:
        length = ascii_int(header_length.strip())
        if length is None or length > len(body):
            raise ApiError(400, "Inference-Header-Content-Length is not a length within the body")
        binary = body[length:]
        body = body[:length]
    doc = _load_json(body)
    if not isinstance(doc, dict):
        raise ApiError(400, "request body must be a JSON object")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ApiError(400, "id: must be a string")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ApiError(400, "inputs: must be a non-empty list")
    names: list[str] = []
    arrays: list[np.ndarray] = []
    offset = 0
    for i, item in enumerate(inputs):
        array, used = _parse_input(item, i, route, binary, offset, inputs[:i])
        offset += used
        names.append(item["name"])
        arrays.append(array)
    if offset != len(binary):
        raise ApiError(400, "binary data: the body holds more bytes than the inputs declare")
    check_complete(route, names)
    outputs, binary_outputs = _parse_outputs(doc, route)
    return ParsedInfer(request_id, names, arrays, outputs, binary_outputs, doc.get("parameters"))


def _parse_input(
    item: object, i: int, route: Route, binary: bytes, offset: int, seen: list[Any]
) -> tuple[np.ndarray, int]:
    where = f"inputs[{i}]"
    if not isinstance(item, dict):
        raise ApiError(400, f"{where}: must be an object with name, shape, datatype and data")
    name = item.get("name")
    if not isinstance(name, str):
        raise ApiError(400, f"{where}.name: must be a string")
    where = f"inputs[{i}] ({name!r})"
    shape = item.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ApiError(400, f"{where}.shape: must be a list of non-negative integers")
    spec = check_input(route, name, item.get("datatype"), where, [s.get("name") for s in seen])
    if len(shape) != len(spec.shape):  # before any array is shaped: numpy takes 64 dims at most
        raise ApiError(
            400,
            f"{where}: shape {shown(shape)} does not match the signature "
            f"{list(spec.shape)} of input {name!r}",
        )
    # Python integers: a hostile shape's product cannot wrap around to a small number.
    count = math.prod(shape)
    params = item.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is not None and spec.datatype == "BYTES":
        # Elements of any length: the size is only bounded by the body; what it holds must be
        # exactly the shape's count of length-prefixed elements.
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or not 0 <= size <= len(binary) - offset
        ):
            raise ApiError(
                400,
                f"{where}.parameters.binary_data_size: {shown(size)} is not a byte count "
                "within the body",
            )
        try:
            array = bytes_tensors.from_buffer(memoryview(binary)[offset : offset + size], count)
        except bytes_tensors.BytesError as exc:
            raise ApiError(400, f"{where}: {exc}") from None
        array = _shaped(array, shape, where)
        check_tensor(spec, array, where)
        return array, size
    if size is not None:
        expected = count * spec.dtype.itemsize
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or size != expected
            or offset + size > len(binary)
        ):
            raise ApiError(
                400,
                f"{where}.parameters.binary_data_size: shape {shown(shape)} needs "
                f"{expected} bytes, got {shown(size)}"
                + ("" if offset + expected <= len(binary) else " (past the end of the body)"),
            )
        array = _shaped(np.frombuffer(binary, spec.dtype, count, offset), shape, where)
        check_tensor(spec, array, where)
        return array, size
    if spec.datatype == "BYTES":
        try:
            array = bytes_tensors.from_json(item.get("data"))
        except bytes_tensors.BytesError as exc:
            raise ApiError(400, f"{where}.data: {exc}") from None
    else:
        array = _from_json_data(item.get("data"), spec.dtype, where)
    if array.size != count:
        raise ApiError(
            400, f"{where}.shape: {shown(shape)} holds {count} values but data has {array.size}"
        )
    array = _shaped(array, shape, where)
    check_tensor(spec, array, where)
    return array, 0


def _shaped(array: np.ndarray, shape: list[int], where: str) -> np.ndarray:
    try:
        return array.reshape(shape)
    except ValueError:  # an empty tensor whose other dimensions numpy cannot address
        raise ApiError(400, f"{where}.shape: {shown(shape)} is too large to address") from None


def _from_json_data(data: object, dtype: np.dtype, where: str) -> np.ndarray:
    if not isinstance(data, list):
        raise ApiError(400, f"{where}.data: must be a list of numbers")
    try:
        if dtype.kind == "f":
            return np.asarray(data, dtype=dtype)
        array = np.asarray(data)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # OverflowError: an integer past a float (10**400) for a float tensor
        raise ApiError(400, f"{where}.data: not a list of numbers ({shown(str(exc))})") from None
    allowed = "b" if dtype.kind == "b" else "iub"
    if array.size and array.dtype.kind not in allowed:
        raise ApiError(
            400,
            f"{where}.data: values must be {NUMPY_TO_OIP[dtype]} (got {array.dtype.name} values)",
        )
    if array.size and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise ApiError(400, f"{where}.data: values out of range for {NUMPY_TO_OIP[dtype]}")
    return array.astype(dtype)


def _parse_outputs(doc: dict[str, Any], route: Route) -> tuple[list[str] | None, set[str]]:
    params = doc.get("parameters")
    all_binary = isinstance(params, dict) and bool(params.get("binary_data_output"))
    requested = doc.get("outputs")
    if requested is None:
        return None, set(route.output_names) if all_binary else set()
    if not isinstance(requested, list):
        raise ApiError(400, "outputs: must be a list of {name}")
    names: list[str] = []
    binary: set[str] = set()
    for i, item in enumerate(requested):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or name not in route.output_names:
            raise ApiError(
                400,
                f"outputs[{i}].name: unknown output {shown(name)}; the model has "
                f"{list(route.output_names)}",
            )
        names.append(name)
        item_params = item.get("parameters") or {}
        if all_binary or (isinstance(item_params, dict) and item_params.get("binary_data")):
            binary.add(name)
    return names, binary


# Says a prediction was answered by a lower step of the model's fallback ladder.
DEGRADED_HEADER = "x-switchyard-degraded"


def render_infer(
    route: Route,
    request_id: str | None,
    outputs: list[tuple[str, np.ndarray]],
    binary: set[str],
    arm: str | None = None,
    degraded: str | None = None,
) -> tuple[bytes, list[tuple[str, str]]]:
    """The response body and its extra headers (binary outputs follow the JSON header)."""
    tensors = []
    blobs = []
    # A classifier's probabilities say which class each column is (read from the artifact).
    parameters_of = {o["name"]: o["parameters"] for o in route.outputs if "parameters" in o}
    for name, array in outputs:
        tensor: dict[str, Any] = {
            "name": name,
            "datatype": "BYTES" if array.dtype.kind in "OUS" else NUMPY_TO_OIP[array.dtype],
            "shape": list(array.shape),
        }
        if name in parameters_of:
            tensor["parameters"] = dict(parameters_of[name])
        if name in binary:
            if tensor["datatype"] == "BYTES":
                blob = bytes_tensors.to_buffer(array)
            else:
                blob = np.ascontiguousarray(array).tobytes()
            tensor["parameters"] = {**tensor.get("parameters", {}), "binary_data_size": len(blob)}
            blobs.append(blob)
        elif tensor["datatype"] == "BYTES":
            tensor["data"] = bytes_tensors.to_json(array)
        else:
            tensor["data"] = np.ascontiguousarray(array).ravel()
        tensors.append(tensor)
    doc: dict[str, Any] = {
        "model_name": route.model_name,
        "model_version": str(route.version),
        "outputs": tensors,
    }
    if request_id is not None:
        doc["id"] = request_id
    extra = []
    parameters = {}
    if arm is not None:  # a rollout plan chose the version: say which arm answered
        parameters["arm"] = arm
        extra.append(("x-switchyard-arm", arm))
    if degraded is not None:  # the model's fallback ladder answered: say which step
        parameters["degraded"] = degraded
        extra.append((DEGRADED_HEADER, degraded))
    if parameters:
        doc["parameters"] = parameters
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, [("content-type", "application/json"), *extra]
    return b"".join([head, *blobs]), [
        ("content-type", "application/octet-stream"),
        ("inference-header-content-length", str(len(head))),
        *extra,
    ]
