"""Reading a job's input (JSON Lines, CSV, Parquet) as rows of named features: checked as a
whole at submission (format, columns, at least one row), and row by row when a chunk runs, where
a row that cannot be converted is a failed row with its error, not a failed job."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import IO, Any

import numpy as np
import orjson

from platform_site.errors import Invalid
from registry.models import ModelVersion
from serving_agent.protocol import OIP_TO_NUMPY

# Rows of a job's input are numbered from 0 in the order of the file (a CSV's header is not a
# row); outputs and errors carry that number.


@dataclass(frozen=True)
class Signature:
    """What a row must hold for a version: its feature names and how each becomes a tensor.

    With ``feature_names`` the version has one input of shape ``[N, len(features)]`` (as the
    prediction API maps rows); otherwise each input is a feature of its own name."""

    features: tuple[str, ...]
    inputs: tuple[dict[str, Any], ...]
    tabular: bool  # one input, a column per feature

    @classmethod
    def of(cls, version: ModelVersion) -> Signature:
        inputs = tuple(version.inputs or [])
        if version.feature_names:
            return cls(tuple(version.feature_names), inputs[:1], True)
        return cls(tuple(i["name"] for i in inputs), inputs, False)

    def datatype(self, feature: str) -> str:
        if self.tabular:
            return str(self.inputs[0]["datatype"])
        return str(next(i["datatype"] for i in self.inputs if i["name"] == feature))


class RowError(ValueError):
    """A row that cannot be sent: the message names the feature."""


def check_input(fh: IO[bytes], fmt: str, signature: Signature, every: int) -> tuple[int, list[int]]:
    """The number of rows of a whole input, after checking its format and its header (CSV) or
    columns (Parquet) against the version's features (``Invalid`` naming the problem); and for
    the text formats the byte offset of every ``every``-th row, where each chunk starts reading
    (so a chunk never reads the rows before its own)."""
    if fmt == "parquet":
        return _check_parquet(fh, signature), []
    try:
        return _check_text(fh, fmt, signature, every)
    except csv.Error as exc:  # a field past csv's size limit, a quote left open at the end
        raise Invalid("file", f"not a readable CSV file ({str(exc)[:200]})") from None


def _check_text(fh: IO[bytes], fmt: str, signature: Signature, every: int) -> tuple[int, list[int]]:
    lines = _Lines(fh)
    records: Iterator[object] = lines
    if fmt == "csv":
        reader = csv.reader(lines)
        header = next(reader, None)
        if header is None:
            raise Invalid("file", "the CSV file is empty (no header row)")
        _check_columns([h.strip() for h in header], signature, "CSV header")
        records = reader
    rows, offsets = 0, []
    while True:
        at = lines.position  # csv.reader pulls a line at a time, only as its record needs
        if next(records, None) is None:
            break
        if rows % every == 0:
            offsets.append(at)
        rows += 1
    if rows == 0:
        raise Invalid("file", "the input has no rows")
    return rows, offsets


def _check_parquet(fh: IO[bytes], signature: Signature) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(fh).metadata
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise Invalid("file", f"not a Parquet file ({str(exc)[:200]})") from None
    _check_columns(list(meta.schema.names), signature, "Parquet columns")
    return int(meta.num_rows)


def _check_columns(columns: list[str], signature: Signature, what: str) -> None:
    missing = [f for f in signature.features if f not in columns]
    if missing:
        raise Invalid("file", f"the {what} lack the feature(s) {missing[:20]}")
    unknown = [c for c in columns if c not in signature.features]
    if unknown:
        raise Invalid(
            "file",
            f"the {what} name unknown feature(s) {unknown[:20]}; "
            f"the model takes {list(signature.features)[:50]}",
        )


class _Lines:
    """Text lines of a binary file, counting the bytes read (the next line's offset). Bytes
    that are not UTF-8 are replaced (and fail that row); UTF-8 never has a newline byte inside
    a character, so reading line by line is safe."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.position = fh.tell()

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        line = self.fh.readline()
        if not line:
            raise StopIteration
        self.position += len(line)
        return line.decode("utf-8", errors="replace")


def read_rows(fh: IO[bytes], fmt: str, start: int, end: int, offset: int | None) -> list[object]:
    """Rows ``[start, end)`` as they are in the file (``offset``: where row ``start`` begins, for
    the text formats): a dict of column to value for CSV and Parquet, a JSON line's text for
    JSON Lines (parsed by ``convert_row``)."""
    if fmt == "parquet":
        return _parquet_rows(fh, start, end)
    if fmt == "csv":
        header = [h.strip() for h in next(csv.reader(_Lines(fh)))]
        fh.seek(offset or 0)
        rows: list[object] = []
        for values in islice(csv.reader(_Lines(fh)), end - start):
            if len(values) != len(header):
                rows.append(RowError(f"has {len(values)} fields; the header has {len(header)}"))
            else:
                rows.append(dict(zip(header, values, strict=True)))
        return rows
    fh.seek(offset or 0)
    return list(islice(_Lines(fh), end - start))


def _parquet_rows(fh: IO[bytes], start: int, end: int) -> list[object]:
    """Only the row groups that hold rows ``[start, end)`` are read."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(fh)
    groups: list[int] = []
    first, skip = 0, 0
    for g in range(parquet.metadata.num_row_groups):
        n = parquet.metadata.row_group(g).num_rows
        if first < end and first + n > start:
            if not groups:
                skip = start - first
            groups.append(g)
        first += n
    return list(parquet.read_row_groups(groups).slice(skip, end - start).to_pylist())


def convert_row(raw: object, signature: Signature, from_text: bool) -> list[Any]:
    """One value per input (for a tabular version: one list of the features in order), checked
    against the datatypes; ``RowError`` naming what is wrong. ``from_text``: CSV cells, whose
    numbers arrive as text."""
    if isinstance(raw, RowError):
        raise raw
    if isinstance(raw, str):
        text = raw.strip()
        if not text:
            raise RowError("empty line")
        try:
            raw = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise RowError(f"not JSON ({str(exc)[:100]})") from None
    if not isinstance(raw, dict):
        raise RowError("must be an object of feature name to value")
    unknown = [k for k in raw if k not in signature.features]
    if unknown:
        raise RowError(f"{str(unknown[0])[:60]}: unknown feature")
    values = []
    for feature in signature.features:
        if feature not in raw:
            raise RowError(f"{feature}: missing feature")
        values.append(_value(raw[feature], signature, feature, from_text))
    return [values] if signature.tabular else values


def _value(value: object, signature: Signature, feature: str, from_text: bool) -> Any:
    datatype = signature.datatype(feature)
    if datatype == "BYTES":
        if not isinstance(value, str):
            raise RowError(f"{feature}: must be text")
        return value
    dtype = np.dtype(OIP_TO_NUMPY[datatype])
    if from_text and isinstance(value, str):
        text = value
        try:
            value = float(text) if dtype.kind == "f" else int(text)
        except ValueError:
            raise RowError(f"{feature}: {text[:40]!r} is not a {datatype} number") from None
    if signature.tabular:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RowError(f"{feature}: must be a number, not {type(value).__name__}")
        return value
    try:
        array = np.asarray(value, dtype=dtype)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise RowError(f"{feature}: not {datatype} values") from None
    spec = next(i for i in signature.inputs if i["name"] == feature)
    inner = list(spec.get("shape") or [])[1:]
    if len(inner) != array.ndim or any(
        d > 0 and d != n for d, n in zip(inner, array.shape, strict=True)
    ):
        raise RowError(f"{feature}: shape {list(array.shape)} does not fit {inner}")
    return array.tolist()
