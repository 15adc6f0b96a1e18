"""The prediction log's format, shared by its writer (``gateway.predlog``, in every gateway
process) and its readers (drift, quality, the API and pages): how tensors become columns, which
output gives a row's score, and how long rows are kept.

The log is the ``predictions`` dataset of ``monitoring.logstore``: one Parquet row per logged
request. Numeric inputs and outputs are typed list columns, one per feature (``f.<feature>``,
a list of one value per row of the request) and per output (``o.<output>``), so drift reads
columns, not JSON; whatever is not numeric (text, booleans, personal fields once redacted or
hashed, the shape of an image) is JSON text in ``inputs`` and ``outputs``. A reader sees a
request's inputs as the union of the two (``request_inputs``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from django.db.models import Max, QuerySet
from django.utils import timezone

from registry.models import Model, TaskKind

from .generation_log import GENERATIONS
from .logstore import HOUR, Partition, hour_of, log_store, register_dataset
from .models import Feedback

PREDICTIONS = "predictions"
FEATURE = "f."  # the prefix of a typed input column
OUTPUT = "o."  # the prefix of a typed output column
UTC_MICROS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema(
    [
        ("tenant_id", pa.int64()),
        ("model_id", pa.int64()),
        ("version_id", pa.int64()),
        ("arm", pa.string()),
        ("request_id", pa.string()),
        ("trace_id", pa.string()),
        ("created_at", UTC_MICROS),
        ("latency_ms", pa.float64()),
        ("status", pa.int32()),
        ("rows", pa.int32()),
        ("inputs", pa.string()),  # JSON {column: [value per row]} of the untyped columns
        ("outputs", pa.string()),  # the same for outputs
        ("scores", pa.list_(pa.float64())),  # one per row (float32 where the model's was)
    ]
)
register_dataset(PREDICTIONS, SCHEMA)
# The log datasets that retention and compaction keep: predictions, and generators' generations
# (``generation_log``), each under its model's ``log_retention_days``.
LOGS = (PREDICTIONS, GENERATIONS)
# A closed hour is compacted once no writer should still be adding to it: past the buffer's
# worth of a stall and a flush or two.
COMPACT_AFTER = timedelta(minutes=15)
FLOAT_TYPES = {"FP16", "FP32", "FP64", "BF16"}
NUMPY = orjson.OPT_SERIALIZE_NUMPY
PURGE_CHUNK = 5000


def score_output(task: str, outputs: Sequence[dict[str, Any]]) -> str | None:
    """The output whose rows give the score: a classifier's probabilities (its first float
    output of two dimensions, not a label output), else the first output."""
    if not outputs:
        return None
    if task == TaskKind.CLASSIFIER:
        for spec in outputs:
            if len(spec["shape"]) == 2 and spec["datatype"] in FLOAT_TYPES:
                return spec["name"]
    return outputs[0]["name"]


def row_scores(task: str, array: np.ndarray) -> list[float | None]:
    """One number per row: a classifier's positive-class probability ([n,2] → column 1, [n,1]
    or [n] → the value, [n,k>2] → the top class's), a regressor's value; [] when there is none
    (several regression targets, higher-rank outputs, generators)."""
    scores = score_array(task, array)
    return [] if scores is None else jsonable(scores)


def score_array(task: str, array: np.ndarray) -> np.ndarray | None:
    """``row_scores`` as an array (in the model's float precision when below 64 bits: its 0.1
    is logged as 0.1); None when there is none."""
    source = np.asarray(array)
    if source.dtype.kind not in "biuf":
        return None
    a = source.astype(np.float64)
    if a.ndim < 2:
        a = a.reshape(-1, 1)
    if a.ndim > 2 or task not in (TaskKind.CLASSIFIER, TaskKind.REGRESSOR):
        return None
    if task == TaskKind.REGRESSOR:
        scores = a[:, 0] if a.shape[1] == 1 else None
    else:
        probs = _probabilities(a)
        if probs.shape[1] == 1:
            scores = probs[:, 0]
        else:
            scores = probs[:, 1] if probs.shape[1] == 2 else probs.max(axis=1)
    if scores is None:
        return None
    if source.dtype.kind == "f" and source.dtype.itemsize < 8:
        scores = scores.astype(np.float32)
    return scores


def _probabilities(a: np.ndarray) -> np.ndarray:
    """Scores are probabilities; a model exporting logits gets its sigmoid or softmax."""
    in_unit_range = a.size == 0 or (a.min() >= 0 and a.max() <= 1)
    if a.shape[1] == 1:
        return a if in_unit_range else _sigmoid(a)
    if in_unit_range and np.abs(a.sum(axis=1) - 1).max(initial=0) <= 1e-3:
        return a
    with np.errstate(all="ignore"):  # NaN rows stay NaN and are logged as null
        shifted = np.exp(a - a.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)


def _sigmoid(a: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return 1 / (1 + np.exp(-a))


def _finite_list(a: np.ndarray) -> list[Any]:
    """``tolist()`` with NaN and infinities as None: PostgreSQL's JSON refuses them."""
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        a = a.astype(object)
        a[~np.isfinite(a.astype(np.float64))] = None
    return a.tolist()


def _text(value: object) -> object:
    if not isinstance(value, bytes):
        return value
    # PostgreSQL's JSON has no NUL character: one would fail the whole batch.
    return value.decode("utf-8", "replace").replace("\x00", "\ufffd")


def jsonable(a: np.ndarray) -> list[Any]:
    if a.dtype.kind in "OS":  # BYTES tensors
        return np.vectorize(_text, otypes=[object])(a).tolist() if a.size else a.tolist()
    try:
        # orjson writes a float32 as its shortest text (0.3, where tolist() gives
        # 0.30000001192092896: 40 % more bytes to send and for PostgreSQL to parse), and NaN and
        # infinities as null.
        return orjson.loads(orjson.dumps(np.ascontiguousarray(a), option=NUMPY))
    except TypeError:  # a dtype orjson does not take (complex numbers, strings)
        return _finite_list(a)


# Columns --------------------------------------------------------------------------------------


def value_type_of(dtype: np.dtype[Any]) -> pa.DataType | None:
    """The Arrow type of a typed column for a numpy dtype; None for what stays JSON (text,
    booleans, which drift compares as categories of their own)."""
    if dtype.kind == "f":
        return pa.float32() if dtype.itemsize <= 4 else pa.float64()
    if dtype.kind in "iu":
        return pa.float64()
    return None


def typed_values(values: np.ndarray, kind: pa.DataType) -> pa.Array:
    """A flat numeric array as Arrow, NaN and infinities null (as JSON logged them)."""
    cast = np.ascontiguousarray(values, dtype=kind.to_pandas_dtype())
    if cast.dtype.kind == "f":
        finite = np.isfinite(cast)
        if not finite.all():
            return pa.array(cast, type=kind, mask=~finite)
    return pa.array(cast, type=kind)


def list_column(offsets: np.ndarray, values: pa.Array) -> pa.ListArray:
    """Per request, its rows' values: ``offsets`` (int32, one more than requests) cut ``values``."""
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values)


def matrix_column(offsets: np.ndarray, matrix: np.ndarray, kind: pa.DataType) -> pa.ListArray:
    """Per request, its rows of a 2-D output, each row a list."""
    rows, width = matrix.shape
    inner = pa.ListArray.from_arrays(
        pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32)),
        typed_values(matrix.reshape(-1), kind),
    )
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), inner)


def _is_number(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _numbers(values: object) -> bool:
    return isinstance(values, list) and all(_is_number(v) for v in values)


def _rows_of(record: dict[str, Any]) -> int:
    lengths = [len(v) for v in record["inputs"].values() if isinstance(v, list)]
    scores = record.get("scores")
    return max(lengths, default=len(scores) if isinstance(scores, list) else 0)


def records_table(records: Iterable[dict[str, Any]]) -> pa.Table:
    """Log rows from records of the JSON form ({column: [value per row]} inputs and outputs,
    ``scores``, and the request's fields): numeric columns typed, the rest JSON. For what is not
    built from tensors: the writer's odd requests, the migration of the old table, tests."""
    records = list(records)
    fields: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    typed: dict[str, list[Any]] = {}
    nested: dict[str, bool] = {}  # output column → rows are lists (a 2-D output)
    for i, record in enumerate(records):
        leftover_in: dict[str, Any] = {}
        for name, values in (record.get("inputs") or {}).items():
            if _numbers(values):
                typed.setdefault(FEATURE + name, [None] * i).append(values)
            else:
                leftover_in[name] = values
        leftover_out: dict[str, Any] = {}
        for name, values in (record.get("outputs") or {}).items():
            column = OUTPUT + name
            matrix = isinstance(values, list) and all(_numbers(v) for v in values) and values
            shape_fits = nested.setdefault(column, bool(matrix) and isinstance(values[0], list))
            if (shape_fits and matrix) or (not shape_fits and _numbers(values)):
                typed.setdefault(column, [None] * i).append(values)
            else:
                leftover_out[name] = values
        for column in typed.values():
            if len(column) < i + 1:
                column.append(None)
        scores = record.get("scores")
        for name in SCHEMA.names:
            if name == "inputs":
                value: Any = orjson.dumps(leftover_in).decode() if leftover_in else None
            elif name == "outputs":
                value = orjson.dumps(leftover_out).decode() if leftover_out else None
            elif name == "scores":
                value = scores if _numbers(scores) else []
            elif name == "rows":
                value = record.get("rows", _rows_of(record))
            else:
                value = record.get(name)
            fields[name].append(value)
    columns = {
        name: pa.array(values, type=SCHEMA.field(name).type) for name, values in fields.items()
    }
    for name, values in typed.items():
        inner = pa.list_(pa.float64()) if nested.get(name) else pa.float64()
        columns[name] = pa.array(values, type=pa.list_(inner))
    return pa.table(columns)


def write_records(records: Iterable[dict[str, Any]]) -> list[str]:
    """Write records (``records_table``'s form) to the log now; returns the files written."""
    return log_store().write(PREDICTIONS, records_table(records))


def column_lists(column: pa.ChunkedArray | pa.Array) -> list[Any]:
    """A typed list column as Python lists per request, single floats at their own precision
    (0.1, not 0.10000000149011612)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = column.type
    while pa.types.is_list(kind):
        kind = kind.value_type
    if kind != pa.float32():
        return column.to_pylist()
    flat = pc.list_flatten(column)
    depth = 1
    while pa.types.is_list(flat.type):
        flat = pc.list_flatten(flat)
        depth += 1
    numbers = orjson.loads(orjson.dumps(flat.to_numpy(zero_copy_only=False), option=NUMPY))
    shaped = pa.array(numbers, type=pa.float64())
    # Rebuild the lists around the float64 values, keeping the nulls of each level.
    levels = [column]
    for _ in range(depth - 1):
        levels.append(pc.list_flatten(levels[-1]))
    for level in reversed(levels):
        shaped = pa.ListArray.from_arrays(level.offsets, shaped, mask=level.is_null())
    return shaped.to_pylist()


def request_columns(table: pa.Table, json_name: str, prefix: str) -> list[dict[str, Any]]:
    """Per row of a log table, a request's inputs (or outputs) as they were logged: its typed
    columns (in the table's order) and then its JSON ones."""
    typed = [name for name in table.column_names if name.startswith(prefix)]
    values = {name: column_lists(table[name]) for name in typed}
    texts = table[json_name].to_pylist() if json_name in table.column_names else []
    out = []
    for i in range(table.num_rows):
        row = {
            name[len(prefix) :]: values[name][i] for name in typed if values[name][i] is not None
        }
        if texts and texts[i]:
            row.update(orjson.loads(texts[i]))
        out.append(row)
    return out


def log_rows(table: pa.Table) -> list[dict[str, Any]]:
    """A log table's rows as the JSON form: the request's fields, ``inputs``, ``outputs`` and
    ``scores`` (lists)."""
    inputs = request_columns(table, "inputs", FEATURE)
    outputs = request_columns(table, "outputs", OUTPUT)
    scores = column_lists(table["scores"]) if "scores" in table.column_names else []
    plain = [
        name
        for name in table.column_names
        if name not in ("inputs", "outputs", "scores") and not name.startswith((FEATURE, OUTPUT))
    ]
    columns = {name: table[name].to_pylist() for name in plain}
    return [
        {name: columns[name][i] for name in plain}
        | {
            "inputs": inputs[i],
            "outputs": outputs[i],
            "scores": (scores[i] if scores else []) or [],
        }
        for i in range(table.num_rows)
    ]


def purge_expired_logs(now: datetime | None = None) -> dict[str, int]:
    """Drop each model's hour partitions of the log wholly older than its
    ``log_retention_days`` (a partition goes once its last hour has expired), and delete
    feedback older than the longest retention of its tenant's models, in chunks so no delete
    holds a long lock. Returns the partitions dropped and the feedback rows deleted."""
    now = now or timezone.now()
    store = log_store()
    retention = {
        (tenant_id, pk): days
        for pk, tenant_id, days in Model.objects.values_list(
            "pk", "tenant_id", "log_retention_days"
        )
    }
    default_days = Model._meta.get_field("log_retention_days").default
    partitions = 0
    for dataset in LOGS:
        for tenant_id in store.tenants(dataset):
            for model_id in store.models(dataset, tenant_id):
                # A model deleted since keeps no log: its rows expire at once.
                days = retention.get((tenant_id, model_id))
                cutoff = now - timedelta(days=days) if days is not None else now + HOUR
                partitions += store.drop_before(dataset, tenant_id, model_id, cutoff)
    longest = dict(
        Model.objects.order_by()
        .values("tenant_id")
        .annotate(days=Max("log_retention_days"))
        .values_list("tenant_id", "days")
    )
    feedback = 0
    for tenant_id in Feedback.objects.order_by().values_list("tenant_id", flat=True).distinct():
        days = longest.get(tenant_id, default_days)
        stale = Feedback.objects.filter(
            tenant_id=tenant_id, received_at__lt=now - timedelta(days=days)
        )
        feedback += _delete_in_chunks(stale)
    return {"log_partitions": partitions, "feedback": feedback}


def compact_closed_hours(now: datetime | None = None, lookback_hours: int = 48) -> int:
    """Merge the small files of every closed hour of the last ``lookback_hours`` (each flush of
    each gateway process writes one per partition) into one file per partition; returns how many
    partitions were compacted."""
    now = now or timezone.now()
    store = log_store()
    newest = hour_of(now - COMPACT_AFTER) - HOUR  # the last hour closed long enough
    oldest = newest - (lookback_hours - 1) * HOUR
    compacted = 0
    for dataset in LOGS:
        for tenant_id in store.tenants(dataset):
            for model_id in store.models(dataset, tenant_id):
                for hour in store.hours(dataset, tenant_id, model_id):
                    if oldest <= hour <= newest:
                        merged = store.compact(dataset, Partition(tenant_id, model_id, hour))
                        compacted += merged > 0
    return compacted


def _delete_in_chunks(rows: QuerySet[Any]) -> int:
    total = 0
    while True:
        ids = list(rows.order_by().values_list("pk", flat=True)[:PURGE_CHUNK])
        if not ids:
            return total
        total += rows.model.objects.filter(pk__in=ids).delete()[0]
