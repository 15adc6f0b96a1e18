"""Open Inference Protocol v2 over gRPC: a ``ModelInferRequest`` into the arrays the pipeline
takes (the same signature checks as the REST codec), the outputs into a ``ModelInferResponse``,
and the pipeline's HTTP statuses into gRPC status codes.

Tensors come as typed ``contents`` or as ``raw_input_contents`` (little-endian bytes, one
buffer per input, in order), which tritonclient sends; a request sent raw is answered raw.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import grpc
import numpy as np

from serving_agent.protocol import NUMPY_TO_OIP, wire_array

from . import bytes_tensors
from .checks import check_complete, check_input, check_tensor
from .errors import ApiError
from .parsed import ParsedInfer
from .proto import grpc_predict_v2_pb2 as pb
from .routes import InputSpec, Route

# Where each datatype's values go in InferTensorContents (KServe's table). FP16 has no typed
# field: it travels only as raw bytes.
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# The pipeline answers in HTTP statuses (ApiError, DispatchError); this is their gRPC code, per
# gRPC's own HTTP mapping. A status not listed is a server fault (INTERNAL) if 5xx, else the
# caller's (FAILED_PRECONDITION).
GRPC_CODE = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

ParamValue = bool | int | float | str


def grpc_code(status: int) -> grpc.StatusCode:
    if status in GRPC_CODE:
        return GRPC_CODE[status]
    return grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.FAILED_PRECONDITION


def error_metadata(exc: ApiError) -> list[tuple[str, str]]:
    """The trailers that carry an error's retry hint: HTTP's ``retry-after`` (seconds), and
    gRPC's own ``grpc-retry-pushback-ms``, which a client's retry policy obeys (gRFC A6)."""
    for name, value in exc.headers:
        if name.lower() == "retry-after":
            return [("retry-after", value), ("grpc-retry-pushback-ms", str(int(value) * 1000))]
    return []


def parse_infer(request: pb.ModelInferRequest, route: Route) -> ParsedInfer:
    raw = request.raw_input_contents
    if not request.inputs:
        raise ApiError(400, "inputs: must hold at least one tensor")
    if raw and len(raw) != len(request.inputs):
        raise ApiError(
            400,
            f"raw_input_contents: {len(raw)} buffers for {len(request.inputs)} inputs; "
            "send one per input, in the inputs' order",
        )
    names: list[str] = []
    arrays: list[np.ndarray] = []
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name!r})"
        spec = check_input(route, tensor.name, tensor.datatype, where, names)
        if any(d < 0 for d in tensor.shape):
            raise ApiError(400, f"{where}.shape: must be non-negative integers")
        shape = list(tensor.shape)
        # Python integers: a hostile shape's product cannot wrap around to a small number.
        count = math.prod(shape)
        if raw:
            if tensor.HasField("contents"):
                raise ApiError(400, f"{where}: both contents and raw_input_contents given")
            array = _from_raw(raw[i], spec, shape, count, f"raw_input_contents[{i}]")
        else:
            array = _from_contents(tensor.contents, spec, count, where)
        try:
            array = array.reshape(shape)
        except ValueError:  # an empty tensor whose other dimensions numpy cannot address
            raise ApiError(400, f"{where}.shape: {shape} is too large to address") from None
        check_tensor(spec, array, where)
        names.append(tensor.name)
        arrays.append(array)
    check_complete(route, names)
    return ParsedInfer(request.id or None, names, arrays, _requested(request, route), set())


def _from_raw(
    buffer: bytes, spec: InputSpec, shape: list[int], count: int, where: str
) -> np.ndarray:
    if spec.datatype == "BYTES":  # each element behind its 4-byte little-endian length
        try:
            return bytes_tensors.from_buffer(buffer, count)
        except bytes_tensors.BytesError as exc:
            raise ApiError(400, f"{where}: {exc}") from None
    expected = count * spec.dtype.itemsize
    if len(buffer) != expected:
        raise ApiError(
            400,
            f"{where}: shape {shape} of {spec.datatype} needs {expected} bytes, got {len(buffer)}",
        )
    if spec.datatype == "BOOL" and count and np.frombuffer(buffer, np.uint8).max() > 1:
        raise ApiError(400, f"{where}: BOOL bytes must be 0 or 1")
    return np.frombuffer(buffer, spec.dtype)


def _from_contents(
    contents: pb.InferTensorContents, spec: InputSpec, count: int, where: str
) -> np.ndarray:
    field = CONTENTS_FIELD.get(spec.datatype)
    if field is None:
        raise ApiError(
            400, f"{where}: {spec.datatype} has no typed contents; send raw_input_contents"
        )
    values = getattr(contents, field)
    if len(values) != count:
        others = [f.name for f, _ in contents.ListFields() if f.name != field]
        hint = f" ({spec.datatype} values go in {field}, not {others[0]})" if others else ""
        raise ApiError(
            400,
            f"{where}.contents: the shape holds {count} values but {field} has {len(values)}{hint}",
        )
    if spec.datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array
    if spec.dtype.kind in "iu":
        wide = np.array(values, np.uint64 if spec.dtype.kind == "u" else np.int64)
        info = np.iinfo(spec.dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise ApiError(400, f"{where}.contents: values out of range for {spec.datatype}")
        return wide.astype(spec.dtype)
    return np.array(values, spec.dtype)


def _requested(request: pb.ModelInferRequest, route: Route) -> list[str] | None:
    if not request.outputs:
        return None
    names = []
    for i, output in enumerate(request.outputs):
        if output.name not in route.output_names:
            raise ApiError(
                400,
                f"outputs[{i}].name: unknown output {output.name!r}; the model has "
                f"{list(route.output_names)}",
            )
        names.append(output.name)
    return names


def request_parameters(parameters: Mapping[str, pb.InferParameter]) -> dict[str, ParamValue]:
    """The request's ``parameters`` as plain values, the shape the REST body's JSON
    ``parameters`` object has, so both front doors can hand the same options to the pipeline."""
    values: dict[str, ParamValue] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        if which is None:
            raise ApiError(400, f"parameters[{key!r}]: holds no value")
        values[key] = getattr(parameter, which)
    return values


def _datatype(array: np.ndarray) -> str:
    return "BYTES" if array.dtype.kind in "OUS" else NUMPY_TO_OIP[array.dtype]


def render_infer(
    route: Route,
    request_id: str | None,
    outputs: list[tuple[str, np.ndarray]],
    raw: bool,
    arm: str | None = None,
    degraded: str | None = None,
) -> pb.ModelInferResponse:
    reply = pb.ModelInferResponse(
        model_name=route.model_name, model_version=str(route.version), id=request_id or ""
    )
    # The protocol has raw outputs for all tensors or none; FP16 has no typed field.
    raw = raw or any(_datatype(a) not in CONTENTS_FIELD for _, a in outputs)
    for name, array in outputs:
        datatype = _datatype(array)
        tensor = reply.outputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw and datatype == "BYTES":
            reply.raw_output_contents.append(bytes_tensors.to_buffer(array))
        elif raw:
            reply.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
        elif datatype == "BYTES":
            tensor.contents.bytes_contents.extend(wire_array(array).ravel().tolist())
        else:
            getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(array.ravel().tolist())
    if arm is not None:  # a rollout plan chose the version: say which arm answered
        reply.parameters["arm"].string_param = arm
    if degraded is not None:  # the model's fallback ladder answered: say which step
        reply.parameters["degraded"].string_param = degraded
    return reply
