"""Drift: how far a version's recent inputs and scores have moved from its reference sample, and
data-quality counts on the recent window. The beat task writes one ``DriftReport`` per version
per run and raises (or resolves) the version's drift alert; the guardrails read the reports.

Measures, per feature and on the output scores:

- PSI (population stability index) over bins fixed by the reference:
  ``PSI = sum_i (c_i - r_i) * ln(c_i / r_i)`` where ``r_i`` and ``c_i`` are the reference's and
  the current window's shares in bin ``i``, each floored at ``EPSILON`` so an empty bin gives a
  large but finite term. Numeric bins are the reference's deciles (deduplicated), the outer two
  open-ended, so values beyond the reference's range land in the first or last bin. Rule of
  thumb: below 0.1 stable, 0.1–0.2 moderate, above 0.2 (the default threshold) a real shift.
- Numeric features: the two-sample Kolmogorov–Smirnov statistic and p-value (``ks_2samp``).
- Categorical features: PSI over categories and the Jensen–Shannon distance (base 2: 0 for the
  same distribution, 1 for disjoint ones). Current values never seen in the reference share one
  ``(unseen)`` category.

A feature is categorical when its reference values are strings or booleans, or numbers with at
most ``CATEGORICAL_MAX_DISTINCT`` distinct values (codes, flags, small counts): deciles of such a
feature collapse into a few uneven bins, while categories compare them exactly.

The window comes from the Parquet log through DuckDB: numeric features and the scores are typed
columns, read as numpy arrays and compared without a Python object per value (a million rows in
well under the 5 s bench/README.md sets); only the features logged as JSON (text, booleans) are
parsed.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from django.conf import settings
from django.core.exceptions import ValidationError
from django.utils import timezone

from registry.models import Model, ModelVersion, ReferenceSample
from registry.reference import MAX_ROWS, MIN_ROWS, save_reference, value_type
from tenants.audit import Actor

from .alerts import raise_alert, resolve_alert
from .logstore import log_store, quote, scalar, view_columns
from .models import AlertKind, DriftReport
from .prediction_log import FEATURE, PREDICTIONS

log = logging.getLogger(__name__)

BINS = 10
EPSILON = 1e-4
CATEGORICAL_MAX_DISTINCT = 10
MAX_CATEGORIES = 30  # the reference's most frequent categories; the rest share "(other)"
UNSEEN = "(unseen)"
OTHER = "(other)"
SCORE = "score"
# The drift job reads up to this many of a window's newest rows (a reference keeps MAX_ROWS).
WINDOW_MAX_ROWS = 1_000_000


class _Missing:
    """A feature absent from a logged request (a schema violation, unlike a null value)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


@dataclass
class NumericColumn:
    """A typed column of the window: a float per row (NaN for null) and where the request
    lacked the feature."""

    values: np.ndarray
    missing: np.ndarray  # bool per row

    def __len__(self) -> int:
        return len(self.values)

    def as_list(self, keep: np.ndarray | None = None) -> list[Any]:
        """The values as the JSON form has them: floats, None for null, MISSING."""
        values, missing = self.values, self.missing
        if keep is not None:
            values, missing = values[keep], missing[keep]
        out: list[Any] = [None if v != v else v for v in values.tolist()]
        for i in np.flatnonzero(missing):
            out[i] = MISSING
        return out


Column = list[Any] | NumericColumn


def as_list(column: Column) -> list[Any]:
    return column.as_list() if isinstance(column, NumericColumn) else column


# The measures ---------------------------------------------------------------------------------


def bin_edges(reference: np.ndarray, bins: int = BINS) -> np.ndarray:
    """The reference's quantiles, deduplicated (a value repeated across deciles is one edge)."""
    return np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)))


def bin_shares(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Share of ``values`` per bin; the outer bins are open-ended (``edges`` has one more entry
    than there are bins, its first and last only mark the reference's range)."""
    index = np.searchsorted(edges[1:-1], values, side="right")
    counts = np.bincount(index, minlength=len(edges) - 1)
    return counts / max(len(values), 1)


def psi_of_shares(reference: np.ndarray, current: np.ndarray) -> float:
    r = np.maximum(np.asarray(reference, dtype=float), EPSILON)
    c = np.maximum(np.asarray(current, dtype=float), EPSILON)
    return float(np.sum((c - r) * np.log(c / r)))


def psi(reference: Any, current: Any, bins: int = BINS) -> float:
    """PSI of two numeric samples over the reference's quantile bins (see the module doc)."""
    reference = np.asarray(reference, dtype=float)
    edges = bin_edges(reference, bins)
    return psi_of_shares(
        bin_shares(reference, edges), bin_shares(np.asarray(current, dtype=float), edges)
    )


def ks(reference: Any, current: Any) -> tuple[float, float]:
    """The two-sample Kolmogorov–Smirnov statistic and its p-value."""
    # scipy.stats costs ~0.5 s to import, and every Django process imports this module (the
    # rollouts admin, through approvals): only a drift run pays for it.
    from scipy.stats import ks_2samp

    result = ks_2samp(np.asarray(reference, dtype=float), np.asarray(current, dtype=float))
    return float(result.statistic), float(result.pvalue)


# Values, types and the reference's profile of a feature --------------------------------------


def category(value: Any) -> str:
    """A value's category label: the same for 1 and 1.0, JSON-safe as a key and in charts."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    return str(value)


@dataclass(frozen=True)
class Profile:
    """What the reference says about one feature: its type, kind and valid values."""

    kind: str  # "numeric" or "categorical"
    type: str  # "number", "string" or "boolean": another type in the window is a violation
    values: np.ndarray | list[str]  # floats (numeric) or category labels (categorical)

    @property
    def numbers(self) -> np.ndarray:
        """A numeric profile's values."""
        assert isinstance(self.values, np.ndarray), "a categorical profile has no numbers"
        return self.values

    @property
    def labels(self) -> list[str]:
        """A categorical profile's values."""
        assert isinstance(self.values, list), "a numeric profile has no category labels"
        return self.values

    @property
    def low(self) -> float:
        return float(np.min(self.numbers))

    @property
    def high(self) -> float:
        return float(np.max(self.numbers))


def profile(values: list[Any]) -> Profile | None:
    """The reference profile of one feature, or None when it holds no usable value."""
    types = Counter(t for t in map(value_type, values) if t in ("number", "string", "boolean"))
    if not types:
        return None
    vtype = types.most_common(1)[0][0]
    valid = [v for v in values if value_type(v) == vtype]
    if vtype == "number" and len(set(valid)) > CATEGORICAL_MAX_DISTINCT:
        return Profile("numeric", vtype, np.asarray(valid, dtype=float))
    return Profile("categorical", vtype, [category(v) for v in valid])


def split_window(values: Column, ref: Profile) -> tuple[Any, dict[str, int]]:
    """The window's valid values of one feature and its quality counts: nulls, out of range
    (outside the reference's [min, max], or a category the reference never had) and schema
    violations (the feature missing from a request, or a value of another type)."""
    if isinstance(values, NumericColumn):
        return _split_numeric(values, ref)
    valid, nulls, schema = [], 0, 0
    for value in values:
        vtype = None if value is MISSING else value_type(value)
        if value is MISSING or (vtype is not None and vtype != ref.type):
            schema += 1
        elif vtype is None:
            nulls += 1
        else:
            valid.append(value)
    if ref.kind == "numeric":
        current = np.asarray(valid, dtype=float)
        out = int(np.count_nonzero((current < ref.low) | (current > ref.high)))
    else:
        seen = set(ref.values)
        out = sum(category(v) not in seen for v in valid)
    return valid, {"nulls": nulls, "out_of_range": out, "schema": schema}


def _split_numeric(column: NumericColumn, ref: Profile) -> tuple[Any, dict[str, int]]:
    """``split_window`` of a typed column, in numpy."""
    present = ~column.missing
    null = present & np.isnan(column.values)
    numbers = present & ~null
    if ref.type != "number":  # numbers where the reference has text or booleans
        counts = {"nulls": int(null.sum()), "out_of_range": 0, "schema": int(column.missing.sum())}
        counts["schema"] += int(numbers.sum())
        return [], counts
    valid = column.values[numbers]
    if ref.kind == "numeric":
        out = int(np.count_nonzero((valid < ref.low) | (valid > ref.high)))
    else:
        seen = set(ref.values)
        distinct, counts_of = np.unique(valid, return_counts=True)
        out = int(
            sum(c for v, c in zip(distinct, counts_of, strict=True) if category(v) not in seen)
        )
    counts = {"nulls": int(null.sum()), "out_of_range": out, "schema": int(column.missing.sum())}
    return valid, counts


def _labels(valid: Any) -> list[str] | Counter[str]:
    """Category labels of valid values: a count per label for a numpy array."""
    if isinstance(valid, np.ndarray):
        distinct, counts = np.unique(valid, return_counts=True)
        labels: Counter[str] = Counter()
        for value, count in zip(distinct.tolist(), counts.tolist(), strict=True):
            labels[category(value)] += count
        return labels
    return [category(v) for v in valid]


def compare(ref: Profile, valid: Any, threshold: float) -> dict[str, Any]:
    """One feature's (or the scores') entry of a report: distances and chart histograms."""
    entry: dict[str, Any] = {"kind": ref.kind, "values": len(valid)}
    if len(valid) < MIN_ROWS:
        return entry | {"psi": None, "flagged": False}
    if ref.kind == "numeric":
        current = np.asarray(valid, dtype=float)
        edges = bin_edges(ref.numbers)
        r, c = bin_shares(ref.numbers, edges), bin_shares(current, edges)
        statistic, pvalue = ks(ref.numbers, current)
        entry |= {"ks": statistic, "ks_pvalue": pvalue, "edges": edges.tolist()}
    else:
        from scipy.spatial.distance import jensenshannon  # see ks()

        names, r, c = category_shares(ref.labels, _labels(valid))
        entry |= {"distance": float(jensenshannon(r, c, base=2)), "categories": names}
    value = psi_of_shares(r, c)
    return entry | {
        "psi": value,
        "flagged": value > threshold,
        "reference": np.round(r, 6).tolist(),
        "current": np.round(c, 6).tolist(),
    }


def category_shares(
    reference: list[str], current: list[str] | Counter[str]
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Shares over the reference's categories (most frequent first, the tail as "(other)"),
    with current values the reference never had as "(unseen)"."""
    counts = Counter(reference)
    kept = [name for name, _ in counts.most_common(MAX_CATEGORIES)]
    names = kept + [OTHER] if len(counts) > len(kept) else kept
    index = {name: i for i, name in enumerate(kept)}

    def shares(labels: list[str] | Counter[str]) -> np.ndarray:
        bucket = np.zeros(len(names) + 1)  # the last slot is "(unseen)"
        tally = labels if isinstance(labels, Counter) else Counter(labels)
        for label, n in tally.items():
            # A seen label outside the kept ones can only exist when "(other)" does.
            slot = index.get(label, len(kept) if label in counts else len(names))
            bucket[slot] += n
        return bucket / max(sum(tally.values()), 1)

    r, c = shares(reference), shares(current)
    if c[-1] > 0:
        return names + [UNSEEN], r, c
    return names, r[:-1], c[:-1]


# Windows of logged predictions ----------------------------------------------------------------


@dataclass
class Window:
    """Logged predictions as columns (``MISSING`` where a request lacked a feature)."""

    columns: dict[str, Column]
    scores: Column
    rows: int


def read_window(version_id: int, start: datetime, end: datetime, limit: int = MAX_ROWS) -> Window:
    """The version's successful logged predictions in (start, end], its newest requests up to
    ``limit`` rows (the request that crosses it included), newest first."""
    owner = (
        ModelVersion.objects.filter(pk=version_id)
        .values_list("model__tenant_id", "model_id")
        .first()
    )
    if owner is None:
        return Window({}, [], 0)
    store = log_store()
    files = store.files(PREDICTIONS, owner[0], [owner[1]], start, end)
    where = f"version_id = {int(version_id)} AND status = 200 AND rows > 0"
    where += " AND created_at > ? AND created_at <= ?"
    params: list[Any] = [start, end]
    with store.connect(PREDICTIONS, files) as con:
        names = view_columns(con)
        total = scalar(con, f"SELECT sum(rows) FROM log WHERE {where}", params)
        if total and total > limit:
            # The oldest request kept: the newest ones before it hold fewer than limit rows.
            cutoff = scalar(
                con,
                "SELECT min(created_at) FROM (SELECT created_at, sum(rows) OVER (ORDER BY "
                "created_at DESC ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS newer "
                f"FROM log WHERE {where}) WHERE coalesce(newer, 0) < ?",
                [*params, limit],
            )
            where += " AND created_at >= ?"
            params.append(cutoff or end)
        features = [n for n in names if n.startswith(FEATURE)]
        selected = ", ".join(quote(n) for n in ["rows", "scores", "inputs", *features])
        table = con.sql(
            f"SELECT {selected} FROM log WHERE {where} ORDER BY created_at DESC", params=params
        ).to_arrow_table()
    return _window_of(table, features)


def _window_of(table: pa.Table, features: list[str]) -> Window:
    rows = table["rows"].to_numpy().astype(np.int64)
    total = int(rows.sum())
    columns: dict[str, Column] = {
        name[len(FEATURE) :]: _typed(table[name], rows, total, missing_as_null=False)
        for name in features
    }
    for i, text in enumerate(table["inputs"].to_pylist()):
        if not text:
            continue
        at, n = int(rows[:i].sum()), int(rows[i])
        for name, values in orjson.loads(text).items():
            column = columns.get(name)
            if isinstance(column, NumericColumn):
                column = columns[name] = column.as_list()
            if column is None:
                column = columns[name] = [MISSING] * total
            own = values[:n] if isinstance(values, list) else []
            column[at : at + n] = own + [MISSING] * (n - len(own))
    # A request of several regression targets (or none) logs no scores: null on its rows.
    scores = _typed(table["scores"], rows, total, missing_as_null=True)
    return Window(columns, scores, total)


def _typed(
    column: pa.ChunkedArray, rows: np.ndarray, total: int, *, missing_as_null: bool
) -> NumericColumn:
    """A list column of one value per row of each request as one value per row of the
    window: a request that lacks the column (null) gives MISSING rows, or null ones with
    ``missing_as_null``; a list of another length than the request's rows is cut or padded."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy().astype(np.int64)
    present = array.is_valid().to_numpy(zero_copy_only=False)
    whole = present & (lengths == rows)
    values = np.full(total, np.nan)
    on_rows = np.repeat(whole, rows)
    flat = pc.list_flatten(array.filter(pa.array(whole)))
    values[on_rows] = flat.to_numpy(zero_copy_only=False).astype(np.float64)
    missing = ~on_rows
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
    # Rare: a list cut or padded, as the JSON log was.
    for i in np.flatnonzero(present & ~whole & (lengths > 0)):
        own = array[int(i)].as_py()[: rows[i]]
        start = int(starts[i])
        values[start : start + len(own)] = [np.nan if v is None else v for v in own]
        missing[start : start + len(own)] = False
    if missing_as_null:
        missing[:] = False
    return NumericColumn(values, missing)


# Reports --------------------------------------------------------------------------------------


def compare_columns(
    reference: dict[str, Column], window: Window, threshold: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-feature report entries and quality counts; a feature the reference lacks is a
    schema violation on every row that carries a value for it."""
    features, quality = {}, {}
    for name, values in reference.items():
        ref = profile(as_list(values))
        if ref is None:
            continue
        current = window.columns.get(name, [MISSING] * window.rows)
        valid, quality[name] = split_window(current, ref)
        features[name] = compare(ref, valid, threshold)
    for name in window.columns.keys() - reference.keys():
        column = window.columns[name]
        if isinstance(column, NumericColumn):
            present = int((~column.missing).sum())
        else:
            present = sum(v is not MISSING for v in column)
        quality[name] = {"nulls": 0, "out_of_range": 0, "schema": present}
    return features, quality


def compare_scores(reference: Column, current: Column, threshold: float) -> dict[str, Any] | None:
    ref = profile(as_list(reference))
    if ref is None or len(ref.values) < MIN_ROWS:
        return None
    valid, _ = split_window(current, ref)
    return compare(ref, valid, threshold)


def detect_drift(version: ModelVersion, now: datetime | None = None) -> DriftReport | None:
    """Compare the version's window of logged predictions (its model's ``drift_window_minutes``
    up to ``now``) with its reference; store the report and raise or resolve its alert.

    None, with nothing stored and the alert left as it is, when the version has no reference or
    either side has fewer than ``MIN_ROWS`` rows: too little to judge either way.
    """
    now = now or timezone.now()
    model = version.model
    reference = ReferenceSample.objects.filter(version=version).first()
    if reference is None or reference.rows < MIN_ROWS:
        return None
    start = now - timedelta(minutes=model.drift_window_minutes)
    window = read_window(version.pk, start, now, limit=WINDOW_MAX_ROWS)
    if window.rows < MIN_ROWS:
        return None
    threshold = model.drift_threshold
    features, quality = compare_columns(reference.columns, window, threshold)
    score = compare_scores(reference.scores, window.scores, threshold)
    flagged = [name for name, entry in features.items() if entry["flagged"]]
    if score is not None and score["flagged"]:
        flagged.append(SCORE)
    measured = [e["psi"] for e in [*features.values(), score] if e and e["psi"] is not None]
    report = DriftReport.objects.create(
        tenant_id=model.tenant_id,
        model=model,
        version=version,
        window_start=start,
        window_end=now,
        reference_source=reference.source,
        rows_current=window.rows,
        rows_reference=reference.rows,
        threshold=threshold,
        features=features,
        score=score,
        quality=quality,
        flagged=flagged,
        max_psi=max(measured, default=0.0),
        created_at=now,
    )
    _alert(report, version)
    return report


def past_threshold(report: DriftReport, limit: float) -> list[tuple[str, float]]:
    """(name, PSI) of the features (and the scores) whose PSI is past ``limit``, worst first."""
    entries = {**report.features, **({SCORE: report.score} if report.score else {})}
    found = [(n, e["psi"]) for n, e in entries.items() if e.get("psi") is not None]
    return sorted(((n, v) for n, v in found if v > limit), key=lambda item: -item[1])


def describe(report: DriftReport, limit: float) -> str:
    """ "age PSI 0.41, score PSI 0.25 (threshold 0.2)"."""
    named = ", ".join(f"{name} PSI {value:.2f}" for name, value in past_threshold(report, limit))
    return f"{named or 'nothing'} (threshold {limit:g})"


def _alert(report: DriftReport, version: ModelVersion) -> None:
    key = f"drift:{version.pk}"
    if not report.flagged:
        resolve_alert(report.tenant_id, key)
        return
    minutes = version.model.drift_window_minutes
    raise_alert(
        report.tenant_id,
        AlertKind.DRIFT,
        key,
        f"Drift on {version.model.name} v{version.version}",
        f"{describe(report, report.threshold)} over the last {minutes} min "
        f"({report.rows_current} rows; reference: {report.reference_source})",
        model_id=report.model_id,
        details={"report": report.pk, "flagged": report.flagged, "max_psi": report.max_psi},
    )


def detect_all(now: datetime | None = None) -> dict[str, int]:
    """Reports for every version with a reference and logged predictions in its model's
    window; returns how many versions were checked, reported, flagged and failed."""
    now = now or timezone.now()
    counts = {"versions": 0, "reports": 0, "flagged": 0, "failed": 0}
    for model in Model.objects.filter(versions__reference__isnull=False).distinct():
        since = now - timedelta(minutes=model.drift_window_minutes)
        versions = model.versions.filter(
            pk__in=logged_versions(model, since, now), reference__isnull=False
        )
        for version in versions.select_related("model"):
            counts["versions"] += 1
            try:
                report = detect_drift(version, now)
            except Exception:
                # One tenant's malformed data must not stop the others' drift checks.
                log.exception("drift check of version %s failed", version.pk)
                counts["failed"] += 1
                continue
            if report is not None:
                counts["reports"] += 1
                counts["flagged"] += bool(report.flagged)
    return counts


def logged_versions(model: Model, start: datetime, end: datetime | None = None) -> list[int]:
    """Ids of the model's versions with successful requests logged in (start, end]."""
    store = log_store()
    files = store.files(PREDICTIONS, model.tenant_id, [model.pk], start, end)
    where, params = "status = 200 AND created_at > ?", [start]
    if end is not None:
        where += " AND created_at <= ?"
        params.append(end)
    found = store.query(
        PREDICTIONS, files, f"SELECT DISTINCT version_id FROM log WHERE {where}", params
    )
    return found["version_id"].to_pylist()


def has_logs(version: ModelVersion) -> bool:
    """Whether any request of the version is in the log (one query: the files' row-group
    statistics on ``version_id`` let DuckDB skip what cannot match)."""
    store = log_store()
    model = version.model
    files = store.files(PREDICTIONS, model.tenant_id, [model.pk])
    found = store.query(
        PREDICTIONS, files, f"SELECT 1 FROM log WHERE version_id = {int(version.pk)} LIMIT 1"
    )
    return found.num_rows > 0


def purge_reports(now: datetime | None = None) -> int:
    """Delete drift reports past ``SWITCHYARD_DRIFT_HISTORY_DAYS`` (one per version a minute
    adds up); returns how many."""
    horizon = (now or timezone.now()) - timedelta(days=settings.SWITCHYARD_DRIFT_HISTORY_DAYS)
    deleted, _ = DriftReport.objects.filter(created_at__lt=horizon).delete()
    return deleted


def latest_report(version_id: int, since: datetime | None = None) -> DriftReport | None:
    reports = DriftReport.objects.filter(version_id=version_id)
    if since is not None:
        reports = reports.filter(created_at__gte=since)
    return reports.order_by("-created_at").first()


# One arm against another on the same traffic ---------------------------------------------------


@dataclass(frozen=True)
class ArmDrift:
    """A rollout candidate's logged predictions against its baseline's over the same window
    (so the same traffic, split by the plan): the scores decide, the inputs inform (both arms
    see the same input drift, which says nothing against the candidate)."""

    score: dict[str, Any] | None  # ``compare``'s entry for the candidate's scores vs the baseline's
    features: dict[str, dict[str, Any]]  # per input feature, the same: for information only
    rows_baseline: int
    rows_candidate: int
    threshold: float

    @property
    def score_psi(self) -> float | None:
        return None if self.score is None else self.score.get("psi")

    def describe(self) -> str:
        """ "score PSI 0.41 vs the baseline's on the same traffic (threshold 0.2; 400/380
        rows); inputs: age PSI 0.02" """
        inputs = ", ".join(
            f"{name} PSI {entry['psi']:.2f}"
            for name, entry in sorted(self.features.items())
            if entry.get("psi") is not None
        )
        psi = self.score_psi
        shown = "n/a" if psi is None else f"{psi:.2f}"
        return (
            f"score PSI {shown} vs the baseline's on the same traffic (threshold "
            f"{self.threshold:g}; {self.rows_candidate}/{self.rows_baseline} rows)"
            + (f"; inputs: {inputs}" if inputs else "")
        )


def compare_arms(
    baseline_id: int, candidate_id: int, start: datetime, end: datetime, threshold: float
) -> ArmDrift | None:
    """The candidate's scores (and inputs) against the baseline's in (start, end]; None while
    either has fewer than ``MIN_ROWS`` logged rows."""
    base = read_window(baseline_id, start, end)
    cand = read_window(candidate_id, start, end)
    if min(base.rows, cand.rows) < MIN_ROWS:
        return None
    features, _ = compare_columns(base.columns, cand, threshold)
    score = compare_scores(base.scores, cand.scores, threshold)
    return ArmDrift(score, features, base.rows, cand.rows, threshold)


def evidence(version_id: int) -> dict[str, Any] | None:
    """The candidate's latest drift report, as an approval's evidence shows it."""
    report = latest_report(version_id)
    if report is None:
        return None
    return {
        "report": report.pk,
        "at": report.created_at.isoformat(),
        "window_minutes": round((report.window_end - report.window_start).total_seconds() / 60),
        "rows": report.rows_current,
        "max_psi": round(report.max_psi, 4),
        "threshold": report.threshold,
        "flagged": report.flagged,
    }


# References chosen from the log -----------------------------------------------------------------


def set_reference_window(
    version: ModelVersion, start: datetime, end: datetime, actor: Actor
) -> ReferenceSample:
    """Copy a past window of the version's logged predictions into its reference, audited; a
    window over ``MAX_ROWS`` rows is thinned evenly rather than cut at one end."""
    if start >= end:
        raise ValidationError({"window_end": "must be after window_start"})
    if end > timezone.now():
        raise ValidationError({"window_end": "must not be in the future"})
    window = read_window(version.pk, start, end, limit=10 * MAX_ROWS)
    if window.rows < MIN_ROWS:
        raise ValidationError(
            {"window_start": f"the window holds {window.rows} logged rows; at least {MIN_ROWS}"}
        )
    keep = np.linspace(0, window.rows - 1, min(window.rows, MAX_ROWS)).round().astype(int)
    columns = {
        name: [None if v is MISSING else v for v in _pick(values, keep)]
        for name, values in window.columns.items()
    }
    scores = [None if v is MISSING else v for v in _pick(window.scores, keep)]
    if all(s is None for s in scores):
        scores = []
    return save_reference(version, actor, "window", columns, scores, len(keep), start, end)


def _pick(column: Column, keep: np.ndarray) -> list[Any]:
    if isinstance(column, NumericColumn):
        return column.as_list(keep)
    return [column[i] for i in keep]


def reference_summary(sample: ReferenceSample) -> dict[str, dict[str, Any]]:
    """Per feature of a reference: kind, type, non-null count, nulls, and range or top
    categories (what the API's GET shows)."""
    summary: dict[str, dict[str, Any]] = {}
    for name, values in sample.columns.items():
        ref = profile(values)
        nulls = sum(value_type(v) is None for v in values)
        if ref is None:
            summary[name] = {"kind": None, "values": 0, "nulls": nulls}
            continue
        entry: dict[str, Any] = {
            "kind": ref.kind,
            "type": ref.type,
            "values": len(ref.values),
            "nulls": nulls,
        }
        if ref.kind == "numeric":
            entry |= {"min": ref.low, "max": ref.high, "mean": float(np.mean(ref.numbers))}
        else:
            entry |= {"categories": dict(Counter(ref.labels).most_common(MAX_CATEGORIES))}
        summary[name] = entry
    return summary
