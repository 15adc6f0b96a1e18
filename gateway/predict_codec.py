"""Turning the prediction API's plain JSON into tensors checked against the signature."""

from __future__ import annotations

from typing import Any

import numpy as np

from .checks import check_complete, check_tensor
from .errors import ApiError, shown
from .routes import Route


def arrays_from_predict_body(
    body: object, route: Route
) -> tuple[list[str], list[np.ndarray], list[str] | None]:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object with 'instances' or 'inputs'")
    outputs = body.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or any(o not in route.output_names for o in outputs):
            raise ApiError(
                400, f"outputs: must be a list of output names from {list(route.output_names)}"
            )
    if ("instances" in body) == ("inputs" in body):
        raise ApiError(400, "send exactly one of 'instances' (rows) or 'inputs' (columns)")
    if "inputs" in body:
        columns = body["inputs"]
        if not isinstance(columns, dict) or not columns:
            raise ApiError(400, "inputs: must be an object of input name to values")
    else:
        columns = _columns_from_instances(body["instances"], route)
    names, arrays = [], []
    for name, values in columns.items():
        spec = route.input(name)
        if spec is None:
            raise ApiError(
                400,
                f"inputs.{name}: unknown input; the model takes {[s.name for s in route.inputs]}",
            )
        if spec.datatype == "BYTES":
            array = _text_array(values, f"inputs.{name}")
            check_tensor(spec, array, f"inputs.{name}")
            names.append(name)
            arrays.append(array)
            continue
        try:
            array = np.asarray(values, dtype=spec.dtype)
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            # OverflowError: an integer past the dtype (10**400, or 2**70 for INT64)
            raise ApiError(
                400, f"inputs.{name}: not {spec.datatype} values ({shown(str(exc))})"
            ) from None
        check_tensor(spec, array, f"inputs.{name}")
        names.append(name)
        arrays.append(array)
    check_complete(route, names)
    return names, arrays, outputs


def _text_array(values: object, where: str) -> np.ndarray:
    """Strings (nested lists for more dimensions) as a BYTES tensor of their UTF-8 bytes."""
    try:
        array = np.asarray(values, dtype=object)
    except (ValueError, RecursionError):  # ragged nesting
        raise ApiError(400, f"{where}: not BYTES values (lists of strings)") from None
    flat = array.reshape(-1)
    for i, value in enumerate(flat.tolist()):
        if not isinstance(value, str):
            raise ApiError(400, f"{where}: BYTES values must be strings (got {shown(value)})")
        flat[i] = value.encode()
    return array


def _columns_from_instances(instances: object, route: Route) -> dict[str, list[Any]]:
    if not isinstance(instances, list) or not instances:
        raise ApiError(400, "instances: must be a non-empty list of rows")
    if route.feature_names:
        return {
            route.inputs[0].name: [_row_from_features(r, i, route) for i, r in enumerate(instances)]
        }
    if len(route.inputs) == 1 and not isinstance(instances[0], dict):
        return {route.inputs[0].name: instances}
    columns: dict[str, list[Any]] = {spec.name: [] for spec in route.inputs}
    for i, row in enumerate(instances):
        if not isinstance(row, dict):
            raise ApiError(400, f"instances[{i}]: must be an object of input name to value")
        unknown = set(row) - set(columns)
        if unknown:
            raise ApiError(400, f"instances[{i}].{sorted(unknown)[0]}: unknown input")
        for name in columns:
            if name not in row:
                raise ApiError(400, f"instances[{i}].{name}: missing")
            columns[name].append(row[name])
    return columns


def _row_from_features(row: object, i: int, route: Route) -> list[Any]:
    if isinstance(row, list):
        return row
    if not isinstance(row, dict):
        raise ApiError(400, f"instances[{i}]: must be an object of feature name to value")
    unknown = set(row) - set(route.feature_names)
    if unknown:
        raise ApiError(
            400,
            f"instances[{i}].{sorted(unknown)[0]}: unknown feature; the model "
            f"takes {list(route.feature_names)}",
        )
    missing = [f for f in route.feature_names if f not in row]
    if missing:
        raise ApiError(400, f"instances[{i}].{missing[0]}: missing feature")
    return [row[f] for f in route.feature_names]
