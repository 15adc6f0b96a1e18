"""The checks of an inference request's tensors against its version's signature, shared by
every tensor codec (OIP REST and gRPC, the prediction API, embeddings)."""

from __future__ import annotations

import math

import numpy as np

from serving_agent.protocol import OIP_TO_NUMPY

from . import bytes_tensors
from .errors import ApiError, shown
from .routes import InputSpec, Route


def check_input(
    route: Route, name: str, datatype: object, where: str, seen: list[str]
) -> InputSpec:
    """The signature's spec of one named input tensor, refusing a name given twice, a name the
    model does not take and a datatype other than the model's (both codecs, REST and gRPC)."""
    if name in seen:
        raise ApiError(400, f"{where}.name: input {name!r} given twice")
    spec = route.input(name)
    if spec is None:
        raise ApiError(
            400,
            f"{where}.name: unknown input {name!r}; the model takes "
            f"{[s.name for s in route.inputs]}",
        )
    if not isinstance(datatype, str) or datatype not in OIP_TO_NUMPY:
        raise ApiError(400, f"{where}.datatype: unsupported datatype {shown(datatype)}")
    if datatype != spec.datatype:
        raise ApiError(400, f"{where}.datatype: the model expects {spec.datatype}, got {datatype}")
    return spec


def _all_finite(array: np.ndarray) -> bool:
    """No NaN or infinity in ``array``. A finite sum says so in one pass of one ufunc (the
    common case; ``ndarray.all`` goes through numpy's Python wrapper, ~1 % of the gateway's
    CPU per request); a sum that is not finite (NaN, infinity, or finite values summing past
    the dtype's range) is settled value by value."""
    if math.isfinite(np.add.reduce(array, axis=None)):
        return True
    return bool(np.isfinite(array).all())


def check_tensor(spec: InputSpec, array: np.ndarray, where: str) -> None:
    """Refuse a tensor the version's signature does not accept."""
    if len(array.shape) != len(spec.shape) or any(
        want not in (-1, got) for want, got in zip(spec.shape, array.shape, strict=True)
    ):
        raise ApiError(
            400,
            f"{where}: shape {list(array.shape)} does not match the signature "
            f"{list(spec.shape)} of input {spec.name!r}",
        )
    if array.dtype.kind == "f" and not _all_finite(array):
        if not spec.allow_missing:
            raise ApiError(
                400,
                f"{where}: contains NaN or infinity (this version does not allow missing "
                "values: upload it with allow_missing=true to take NaN as one)",
            )
        if np.isinf(array).any():
            raise ApiError(400, f"{where}: contains infinity (only NaN marks a missing value)")
    if spec.datatype == "BYTES":
        try:
            bytes_tensors.check(array, spec.text)
        except bytes_tensors.BytesError as exc:
            raise ApiError(400, f"{where}: {exc}") from None


def check_complete(route: Route, names: list[str]) -> None:
    if route.generates_text:
        raise ApiError(
            400,
            f"model {route.model_name!r} generates text: use the websocket "
            f"/ws/v1/models/{route.model_name}/generate or POST /v1/completions",
        )
    missing = [spec.name for spec in route.inputs if spec.name not in names]
    if missing:
        raise ApiError(
            400,
            f"inputs: missing input {missing[0]!r}; the model takes "
            f"{[s.name for s in route.inputs]}",
        )
