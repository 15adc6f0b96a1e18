"""No weight of an uploaded model may be NaN or infinite, whatever its format.

Such a model loads and answers NaN, NUL bytes or errors on every request (a training run that
diverged writes them), so it is refused at upload, naming the tensor. Each format's check
(``registry.formats``; ONNX's in its child process, ``registry.onnx_check``) reads its
artifact's floating-point tensors one at a time with an iterator here and hands them to
``non_finite``, the one judge. No Django here: the ONNX child imports this module.
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from collections.abc import Iterable, Iterator
from typing import IO, Any, NamedTuple

import ml_dtypes  # onnx's own dependency: numpy has no bfloat16 or float8 types
import numpy as np

# Bytes of a tensor read from a stream at a time (and elements judged at a time): an upload
# of any size is checked in bounded memory.
_CHUNK = 1 << 22


class Tensor(NamedTuple):
    """One floating-point tensor of an artifact: its values come in pieces, so that a tensor
    read from a stream is never held whole."""

    name: str
    size: int  # elements
    pieces: Iterable[np.ndarray]


Weights = Iterable[Tensor]


def non_finite(weights: Weights) -> str | None:
    """The problem with the first tensor holding NaN or ±inf, or None when every one is finite.

    A tensor of one element is not judged: converters write NaN or ±inf constants that way on
    purpose (skl2onnx's marker of a missing value, a mask's fill value), while a model whose
    training diverged has them in its weight matrices, which are always judged.
    """
    for tensor in weights:
        if tensor.size <= 1:
            continue
        for piece in tensor.pieces:
            flat = piece.reshape(-1)
            for start in range(0, flat.size, _CHUNK):
                chunk = flat[start : start + _CHUNK]
                if not np.isfinite(chunk).all():
                    kind = "NaN" if np.isnan(chunk).any() else "infinite values"
                    return (
                        f"weight tensor {tensor.name!r} holds {kind}: a model with NaN or "
                        "infinite weights answers garbage (often a training run that diverged); "
                        "fix the weights before uploading"
                    )
    return None


class _Stream:
    """A binary stream read forward only (an archive's member cannot seek), by position."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.position = 0

    def read(self, n: int) -> bytes:
        parts, left = [], n
        while left > 0:
            part = self._f.read(left)
            if not part:
                raise ValueError("the file ends before its last tensor")
            parts.append(part)
            left -= len(part)
        self.position += n
        return b"".join(parts)

    def pieces(self, start: int, end: int, dtype: Any) -> Iterator[np.ndarray]:
        """The values between byte ``start`` and ``end`` (at or past the position), in pieces."""
        while self.position < start:  # a gap, or a tensor the judge skipped
            self.read(min(_CHUNK, start - self.position))
        step = _CHUNK - _CHUNK % np.dtype(dtype).itemsize
        while self.position < end:
            yield np.frombuffer(self.read(min(step, end - self.position)), dtype)


# safetensors ---------------------------------------------------------------------------------

_SAFETENSORS_FLOATS: dict[str, Any] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": ml_dtypes.bfloat16,
}


def safetensors_weights(f: IO[bytes]) -> Weights:
    """The floating-point tensors of a safetensors file read from a stream, in file order. A
    stream, not ``safetensors.safe_open`` (which needs a path), because an ``hf`` archive's
    weights are members of a tar or zip. The format's check has already checked the header
    (dtypes, shapes, byte ranges within the file that do not overlap)."""
    stream = _Stream(f)
    (header_len,) = struct.unpack("<Q", stream.read(8))
    header = json.loads(stream.read(header_len))
    header.pop("__metadata__", None)
    base = stream.position
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = _SAFETENSORS_FLOATS.get(entry["dtype"])
        if dtype is not None:
            start, end = entry["data_offsets"]
            pieces = stream.pieces(base + start, base + end, dtype)
            yield Tensor(name, math.prod(entry["shape"]), pieces)


# torch.export archives -----------------------------------------------------------------------

# torch._export.serde.schema.ScalarType values of floating-point types.
_TORCH_FLOATS: dict[int, Any] = {
    6: np.dtype("<f2"),
    7: np.dtype("<f4"),
    8: np.dtype("<f8"),
    13: ml_dtypes.bfloat16,
    29: ml_dtypes.float8_e4m3fn,
    30: ml_dtypes.float8_e5m2,
    31: ml_dtypes.float8_e4m3fnuz,
    32: ml_dtypes.float8_e5m2fnuz,
    33: ml_dtypes.float8_e8m0fnu,
}


def torch_weights(file: str | IO[bytes], root: str) -> Weights:
    """The floating-point weights, buffers and constants of a ``torch.export`` archive (checked
    first by ``serving_agent.torch_archive.read_archive``, which found its ``root`` folder):
    raw payloads, each its tensor's whole storage."""
    with zipfile.ZipFile(file) as zf:
        for folder, config in (
            ("weights", "model_weights_config.json"),
            ("constants", "model_constants_config.json"),
        ):
            entries = json.loads(zf.read(f"{root}/data/{folder}/{config}"))["config"]
            for name, payload in entries.items():
                dtype = _TORCH_FLOATS.get(payload["tensor_meta"]["dtype"])
                if dtype is None:
                    continue
                member = zf.getinfo(f"{root}/data/{folder}/{payload['path_name']}")
                size = member.file_size // np.dtype(dtype).itemsize
                with zf.open(member) as f:
                    end = size * np.dtype(dtype).itemsize
                    yield Tensor(name, size, _Stream(f).pieces(0, end, dtype))


# ONNX ----------------------------------------------------------------------------------------


def _onnx_parts(model: Any) -> Iterator[Any]:
    """Every ``GraphProto`` and ``NodeProto`` of an ``onnx.ModelProto``: the main graph, its
    subgraphs (``If``, ``Loop``...) and the nodes of the model's local functions."""
    graphs = [model.graph]
    nodes = [node for function in model.functions for node in function.node]
    while graphs or nodes:
        if graphs:
            graph = graphs.pop()
            nodes.extend(graph.node)
            yield graph
            continue
        node = nodes.pop()
        for attribute in node.attribute:
            if attribute.HasField("g"):
                graphs.append(attribute.g)
            graphs.extend(attribute.graphs)
        yield node


def onnx_tensors(model: Any) -> Iterator[Any]:
    """Every ``TensorProto`` an ``onnx.ModelProto`` stores: initializers (sparse ones too) and
    operators' tensor attributes (``Constant``'s value), wherever they are in the model."""
    for part in _onnx_parts(model):
        if hasattr(part, "initializer"):  # a graph
            yield from part.initializer
            sparse = list(part.sparse_initializer)
        else:
            sparse = []
            for attribute in part.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors
                if attribute.HasField("sparse_tensor"):
                    sparse.append(attribute.sparse_tensor)
                sparse.extend(attribute.sparse_tensors)
        for tensor in sparse:
            yield from (tensor.values, tensor.indices)


def onnx_weights(model: Any) -> Weights:
    """The floating-point tensors of an ``onnx.ModelProto`` whose data it holds itself (the
    upload check refuses external data before this runs), and the float lists of its operators'
    attributes: classic ML converted to ONNX keeps its weights there (a ``LinearClassifier``'s
    ``coefficients``, a tree ensemble's ``nodes_values``). The exporters move constants between
    initializers and ``Constant`` nodes freely, so every stored tensor counts."""
    from onnx import TensorProto, numpy_helper

    floats = {
        value
        for name, value in TensorProto.DataType.items()
        if name.startswith(("FLOAT", "BFLOAT")) or name == "DOUBLE"
    }
    for tensor in onnx_tensors(model):
        if tensor.data_type in floats:
            values = numpy_helper.to_array(tensor)
            yield Tensor(tensor.name, values.size, [values])
    for part in _onnx_parts(model):
        for attribute in getattr(part, "attribute", ()):
            if attribute.floats:
                name = f"{part.name or part.op_type}.{attribute.name}"
                yield Tensor(name, len(attribute.floats), [np.asarray(attribute.floats)])
