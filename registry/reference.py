"""A version's reference sample: the distribution its inputs (and scores) are expected to
follow, uploaded with the version or later, or chosen from a past window of its logged
predictions (``monitoring.drift``). Drift is measured against it.

A sample is columns ``{feature: [value per row]}`` of scalar values (numbers, strings,
booleans, null) and optionally one score per row, with ``MIN_ROWS`` to ``MAX_ROWS`` rows.
"""

from __future__ import annotations

import csv
import io
import math
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from tenants.audit import Actor, audit

from .models import ModelVersion, ReferenceSample

MIN_ROWS = 30  # below this many rows (window or reference) PSI and KS are noise: no report
MAX_ROWS = 100_000  # rows read from a window and kept in a reference (bounds memory and JSON)


def value_type(value: Any) -> str | None:
    """ "number", "string" or "boolean"; None for a null (NaN and infinities count as null);
    "other" for lists and objects."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "other"


def normalize_reference(
    columns: dict[str, list[Any]] | None = None,
    rows: list[dict[str, Any]] | None = None,
    scores: list[Any] | None = None,
) -> tuple[dict[str, list[Any]], list[Any]]:
    """Columns from either shape, checked: equal lengths, scalar values, MIN_ROWS to MAX_ROWS
    rows, and one number per row in ``scores`` when given. Errors name the field."""
    if (columns is None) == (rows is None):
        raise ValidationError("send exactly one of 'rows' or 'columns'")
    if rows is not None:
        if not rows:
            raise ValidationError({"rows": f"needs {MIN_ROWS} to {MAX_ROWS} rows, got 0"})
        if not all(isinstance(row, dict) for row in rows):
            raise ValidationError({"rows": "each row must be an object of feature name to value"})
        names = list(dict.fromkeys(name for row in rows for name in row))
        columns = {name: [row.get(name) for row in rows] for name in names}
        field = "rows"
    else:
        field = "columns"
    if not columns:
        raise ValidationError({field: "the reference has no features"})
    lengths = {len(values) for values in columns.values()}
    if len(lengths) > 1:
        raise ValidationError({field: f"columns differ in length: {sorted(lengths)}"})
    n = lengths.pop()
    if not MIN_ROWS <= n <= MAX_ROWS:
        raise ValidationError({field: f"needs {MIN_ROWS} to {MAX_ROWS} rows, got {n}"})
    for name, values in columns.items():
        if not isinstance(name, str) or not name:
            raise ValidationError({field: "feature names must be non-empty strings"})
        bad = next((v for v in values if value_type(v) == "other"), None)
        if bad is not None:
            raise ValidationError(
                {field: f"{name}: values must be numbers, strings, booleans or null, not {bad!r}"}
            )
    # NaN and infinities are nulls here, and PostgreSQL's JSON refuses them.
    columns = {name: [_finite(v) for v in values] for name, values in columns.items()}
    scores = [_finite(s) for s in scores or []]
    if scores and len(scores) != n:
        raise ValidationError({"scores": f"has {len(scores)} values for {n} rows"})
    if any(value_type(s) not in ("number", None) for s in scores):
        raise ValidationError({"scores": "must be numbers (or null)"})
    return columns, scores


def _finite(value: Any) -> Any:
    return None if value_type(value) is None else value


def rows_from_csv(text: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """Rows from CSV text with a header row: empty cells are null, numbers parsed; a ``_score``
    column holds the scores."""
    reader = csv.DictReader(io.StringIO(text))
    if not reader.fieldnames:
        raise ValidationError("the CSV file has no header row")

    def cell(text: str | None) -> Any:
        if text is None or text.strip() == "":
            return None
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return None
        return int(number) if number.is_integer() and "." not in text else number

    try:
        rows = [{name: cell(value) for name, value in row.items() if name} for row in reader]
    except csv.Error as exc:
        raise ValidationError(f"unreadable CSV: {exc}") from None
    scores = [row.pop("_score", None) for row in rows] if "_score" in reader.fieldnames else []
    return rows, scores


def expected_features(version: ModelVersion) -> list[str] | None:
    """The column names the prediction log gives a version's inputs (``gateway.predlog``): a
    2-D input's feature names (or ``input[j]``), a 1-D or [n, 1] input's own name; None when a
    dynamic width leaves them unknown."""
    names: list[str] = []
    for spec in version.inputs or []:
        shape = spec.get("shape") or []
        if len(shape) > 2:
            continue  # images and sequences are logged as their shape only
        if len(shape) < 2 or shape[1] == 1:
            names.append(spec["name"])
        elif len(version.feature_names) == shape[1] or (shape[1] < 1 and version.feature_names):
            names += version.feature_names
        elif shape[1] < 1:
            return None
        else:
            names += [f"{spec['name']}[{j}]" for j in range(shape[1])]
    return names


def set_reference_upload(
    version: ModelVersion,
    actor: Actor,
    *,
    columns: dict[str, list[Any]] | None = None,
    rows: list[dict[str, Any]] | None = None,
    scores: list[Any] | None = None,
) -> ReferenceSample:
    """Make an uploaded sample the version's drift reference (replacing any), audited."""
    columns, scores = normalize_reference(columns, rows, scores)
    field = "columns" if rows is None else "rows"
    known = expected_features(version)
    unknown = sorted(set(columns) - set(known)) if known is not None else []
    if unknown:
        problem = f"unknown features {unknown}; v{version.version} logs {known}"
        raise ValidationError({field: problem})
    # The log keeps these redacted or hashed: raw reference values would never compare.
    personal = sorted(set(columns) & set(version.personal_fields or {}))
    if personal:
        problem = f"{personal} are personal fields, logged redacted or hashed: leave them out"
        raise ValidationError({field: problem})
    n = len(next(iter(columns.values())))
    return save_reference(version, actor, "upload", columns, scores, n, None, None)


def save_reference(
    version: ModelVersion,
    actor: Actor,
    source: str,
    columns: dict[str, list[Any]],
    scores: list[Any],
    rows: int,
    start: datetime | None,
    end: datetime | None,
) -> ReferenceSample:
    """Make ``columns`` (and ``scores``) the version's reference, replacing any, audited."""
    before = ReferenceSample.objects.filter(version=version).first()
    with transaction.atomic():
        # Two replacements racing: the one-to-one row keeps the last writer's; both are audited.
        sample, _ = ReferenceSample.objects.update_or_create(
            version=version,
            defaults={
                "source": source,
                "columns": columns,
                "scores": scores,
                "rows": rows,
                "window_start": start,
                "window_end": end,
                "uploaded_by_id": actor.user_id,
            },
        )
        audit(
            version.model.tenant_id,
            actor,
            "drift.reference",
            f"{version.model.name} v{version.version}",
            before=_audit_view(before) if before else None,
            after=_audit_view(sample),
        )
    return sample


def _audit_view(sample: ReferenceSample) -> dict[str, Any]:
    view = {"source": sample.source, "rows": sample.rows, "features": sorted(sample.columns)}
    if sample.window_start and sample.window_end:  # a window's reference has both
        view |= {"window_start": sample.window_start.isoformat()}
        view |= {"window_end": sample.window_end.isoformat()}
    return view
