"""Ground truth and online quality: feedback labels joined to logged predictions by request id.

Labels may arrive before the prediction's log row is written or days after; the join happens
when quality is computed, so neither order loses anything. Classifiers get accuracy (the
predicted class: score ≥ 0.5 for binary models, the top class otherwise) and, for binary ones,
AUC; regressors the mean absolute error.

The log is Parquet (``monitoring.prediction_log``), feedback a table in the database (it is
written one label at a time and corrected in place): quality loads the window's labels as an
Arrow table into DuckDB and joins them there with the window's log files; the log browser reads
one page of rows and looks up the labels of the request ids on it.
"""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, overload

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from django.utils import timezone

from registry.models import Model, ModelVersion, TaskKind

from .logstore import hour_of, log_store, quote, scalar, view, view_columns
from .models import Feedback
from .prediction_log import OUTPUT, PREDICTIONS, column_lists, log_rows, score_output

BUCKETS = ("hour", "day")
MAX_FEEDBACK_ITEMS = 10_000
_IN_CHUNK = 1000  # ids per IN (...) list, well inside every backend's parameter limit
# ``matched`` of a feedback post looks for the request ids in this much of the newest log: a
# label comes after its prediction, mostly soon after; older ones still join for quality.
MATCH_WINDOW = timedelta(hours=24)
# Quality joins the labels received since a window's start, less this: a label may come before
# its prediction is logged (a client sending its own request id), not by much.
LABEL_LEAD = timedelta(days=1)


# Feedback ------------------------------------------------------------------------------------


def record_feedback(tenant_id: int, items: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """Store labels by request id, replacing any sent before (a correction); returns (accepted,
    how many of them match a logged prediction so far). A request id sent twice in one call
    keeps its last label."""
    labels = {item["request_id"]: item["label"] for item in items}
    now = timezone.now()
    rows = [
        Feedback(tenant_id=tenant_id, request_id=rid, label=label, received_at=now)
        for rid, label in labels.items()
    ]
    # An upsert on the unique (tenant, request_id): concurrent senders of the same id cannot
    # collide on insert, the last write wins.
    Feedback.objects.bulk_create(
        rows,
        batch_size=_IN_CHUNK,
        update_conflicts=True,
        unique_fields=["tenant", "request_id"],
        update_fields=["label", "received_at"],
    )
    since = now - MATCH_WINDOW
    store = log_store()
    files = store.files(PREDICTIONS, tenant_id, None, start=since, end=now)
    ids = pa.table({"request_id": pa.array(list(labels), pa.string())})
    with store.connect(PREDICTIONS, files) as con:
        view(con, "ids", ids)
        matched = scalar(
            con, "SELECT count(DISTINCT request_id) FROM log SEMI JOIN ids USING (request_id)"
        )
    return len(rows), int(matched or 0)


@dataclass
class LoggedRequest:
    """One logged request as the browser and the API show it (``version`` is its number)."""

    request_id: str
    trace_id: str
    version: int | None
    arm: str
    status: int
    latency_ms: float
    created_at: datetime
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    scores: list[Any]
    label: Any = None  # the feedback's label; None without feedback


class LogSelection:
    """A model's logged requests matching filters, newest first, to count and to page through
    (Django's ``Paginator`` takes it as it takes a queryset). Reads only the model's own files,
    and of those only the hours that hold the page asked for."""

    def __init__(
        self,
        model: Model,
        *,
        version: int | None = None,
        status: int | None = None,
        request_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> None:
        self.model = model
        self.numbers = dict(model.versions.values_list("pk", "version"))
        where: list[str] = ["TRUE"]
        params: list[Any] = []
        if version is not None:
            ids = [pk for pk, number in self.numbers.items() if number == version]
            where.append(f"version_id = {ids[0]}" if ids else "FALSE")
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if request_id:
            where.append("request_id = ?")
            params.append(request_id)
        if since is not None:
            where.append("created_at >= ?")
            params.append(since)
        if until is not None:
            where.append("created_at <= ?")
            params.append(until)
        self.where, self.params = " AND ".join(where), params
        self.store = log_store()
        self.files = self.store.files(PREDICTIONS, model.tenant_id, [model.pk], since, until)
        self._per_hour: list[tuple[datetime, int]] | None = None

    def per_hour(self) -> list[tuple[datetime, int]]:
        """(hour, matching requests), newest first: from the filter's columns only."""
        if self._per_hour is None:
            found = self.store.query(
                PREDICTIONS,
                self.files,
                f"SELECT date_trunc('hour', created_at) AS hour, count(*) AS n FROM log "
                f"WHERE {self.where} GROUP BY ALL ORDER BY 1 DESC",
                self.params,
            )
            self._per_hour = [
                (hour_of(h), n)
                for h, n in zip(found["hour"].to_pylist(), found["n"].to_pylist(), strict=True)
            ]
        return self._per_hour

    def count(self) -> int:
        return sum(n for _, n in self.per_hour())

    def __len__(self) -> int:
        return self.count()

    def __iter__(self) -> Iterator[LoggedRequest]:
        return iter(self.page(0, self.count()))

    @overload
    def __getitem__(self, index: int) -> LoggedRequest: ...
    @overload
    def __getitem__(self, index: slice) -> list[LoggedRequest]: ...
    def __getitem__(self, index: int | slice) -> LoggedRequest | list[LoggedRequest]:
        if isinstance(index, int):
            return self.page(index, 1)[0]
        start, stop = index.start or 0, index.stop
        return self.page(start, (stop if stop is not None else self.count()) - start)

    def page(self, offset: int, limit: int) -> list[LoggedRequest]:
        """``limit`` requests from the ``offset``-th newest, with their labels."""
        if limit <= 0:
            return []
        hours, skipped, seen = [], 0, 0
        for hour, n in self.per_hour():
            if seen + n <= offset:
                skipped += n  # wholly before the page: not read at all
            elif seen < offset + limit:
                hours.append(hour)
            seen += n
        if not hours:
            return []
        keep = {h.strftime("hour=%Y-%m-%dT%H/") for h in hours}
        files = [f for f in self.files if any(k in f for k in keep)]
        table = self.store.query(
            PREDICTIONS,
            files,
            f"SELECT * FROM log WHERE {self.where} "
            "ORDER BY created_at DESC, request_id DESC LIMIT ? OFFSET ?",
            [*self.params, limit, offset - skipped],
        )
        rows = log_rows(table)
        labels = labels_of(self.model.tenant_id, [r["request_id"] for r in rows])
        return [
            LoggedRequest(
                request_id=r["request_id"],
                trace_id=r["trace_id"] or "",
                version=self.numbers.get(r["version_id"]),
                arm=r["arm"] or "",
                status=r["status"],
                latency_ms=r["latency_ms"],
                created_at=r["created_at"],
                inputs=r["inputs"],
                outputs=r["outputs"],
                scores=r["scores"],
                label=labels.get(r["request_id"]),
            )
            for r in rows
        ]


EXPORT_FORMATS = ("csv", "parquet")
EXPORT_DEFAULT = timedelta(hours=24)


def export_log(
    model: Model, fmt: str, since: datetime | None = None, until: datetime | None = None
) -> BinaryIO:
    """A model's log rows in [since, until] (by default the last 24 hours) as a CSV or Parquet
    file, oldest first, each with its version number; an open file, already unlinked (it goes
    when closed). DuckDB writes it from the model's own files only."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}")
    until = until or timezone.now()
    since = since or until - EXPORT_DEFAULT
    store = log_store()
    files = store.files(PREDICTIONS, model.tenant_id, [model.pk], since, until)
    numbers = dict(model.versions.values_list("pk", "version"))
    versions = pa.table(
        {
            "version_id": pa.array(list(numbers), pa.int64()),
            "version": pa.array(list(numbers.values()), pa.int64()),
        }
    )
    handle, path = tempfile.mkstemp(suffix=f".{fmt}")
    os.close(handle)
    try:
        with store.connect(PREDICTIONS, files) as con:
            view(con, "versions", versions)
            options = "FORMAT parquet, COMPRESSION zstd" if fmt == "parquet" else "FORMAT csv"
            con.execute(
                "COPY (SELECT v.version, l.* EXCLUDE (tenant_id) FROM log l "
                "LEFT JOIN versions v USING (version_id) "
                "WHERE l.created_at >= ? AND l.created_at <= ? ORDER BY l.created_at) "
                f"TO '{path}' ({options})",
                [since, until],
            ).fetchall()
        return open(path, "rb")  # noqa: SIM115 (the response closes it)
    finally:
        os.unlink(path)


def labels_of(tenant_id: int, request_ids: Sequence[str]) -> dict[str, Any]:
    """The tenant's feedback labels of these request ids."""
    found: dict[str, Any] = {}
    ids = list(dict.fromkeys(request_ids))
    for start in range(0, len(ids), _IN_CHUNK):
        found.update(
            Feedback.objects.filter(
                tenant_id=tenant_id, request_id__in=ids[start : start + _IN_CHUNK]
            ).values_list("request_id", "label")
        )
    return found


def logged_predictions(
    model: Model,
    *,
    version: int | None = None,
    status: int | None = None,
    request_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> LogSelection:
    """A model's logged requests, newest first, each with ``label`` (None without feedback)."""
    return LogSelection(
        model, version=version, status=status, request_id=request_id, since=since, until=until
    )


# Metrics -------------------------------------------------------------------------------------


def auc(scores: Sequence[float], labels: Sequence[float]) -> float | None:
    """Area under the ROC curve by the Mann–Whitney U statistic: the chance that a random
    positive scores above a random negative (ties count one half). None without both classes."""
    y = np.asarray(labels, dtype=bool)
    positives = int(y.sum())
    negatives = len(y) - positives
    if positives == 0 or negatives == 0:
        return None
    from scipy.stats import rankdata  # ~0.5 s to import: only when an AUC is computed

    ranks = rankdata(np.asarray(scores, dtype=np.float64))  # ties share their average rank
    u = ranks[y].sum() - positives * (positives + 1) / 2
    return float(u / (positives * negatives))


@dataclass
class LabelledGroup:
    """One group's counts and its labelled rows: score, predicted class, label."""

    logged: int = 0  # successful requests logged
    labelled: int = 0  # of those, with a label that pairs with their rows
    scores: list[float] = field(default_factory=list)
    predicted: list[int] = field(default_factory=list)
    labels: list[float] = field(default_factory=list)
    binary: bool = True

    def metrics(self, task: str) -> dict[str, Any]:
        n = len(self.labels)
        out: dict[str, Any] = {"logged": self.logged, "labelled": self.labelled, "labelled_rows": n}
        if task == TaskKind.CLASSIFIER:
            hits = sum(p == y for p, y in zip(self.predicted, self.labels, strict=True))
            out["accuracy"] = hits / n if n else None
            binary_labels = self.binary and all(y in (0, 1) for y in self.labels)
            out["auc"] = auc(self.scores, self.labels) if binary_labels and n else None
        elif task == TaskKind.REGRESSOR:
            errors = [abs(s - y) for s, y in zip(self.scores, self.labels, strict=True)]
            out["mae"] = sum(errors) / n if n else None
        return out

    def add(
        self, task: str, scores: list[Any], score_rows: list[Any] | None, label: object
    ) -> None:
        """One labelled request. Its label is one value per row (a list) or a single value
        for a one-row request; a label of another length cannot be paired and is left out."""
        labels = label if isinstance(label, list) else [label]
        if len(labels) != len(scores):
            return
        self.labelled += 1
        for i, (score, y) in enumerate(zip(scores, labels, strict=True)):
            # Unknown rows (a null label, a NaN score) are left out; True counts as class 1.
            if score is None or not isinstance(y, int | float):
                continue
            if task == TaskKind.CLASSIFIER:
                row = score_rows[i] if score_rows and i < len(score_rows) else None
                if isinstance(row, list) and len(row) > 2:
                    self.binary = False
                    predicted = int(np.argmax(row))
                else:
                    predicted = int(score >= 0.5)
                self.predicted.append(predicted)
            self.scores.append(float(score))
            self.labels.append(float(y))


def _score_names(versions: Iterable[ModelVersion]) -> dict[int, str | None]:
    return {v.pk: score_output(v.model.task, v.outputs) for v in versions}


def _labelled_window(
    tenant_id: int,
    model_ids: Sequence[int],
    since: datetime,
    score_names: Iterable[str | None],
    version_ids: Sequence[int] | None = None,
) -> tuple[pa.Table, pa.Table]:
    """The window's successful requests counted per (hour, version, arm), and its labelled
    ones (version, arm, time, scores, the score output's rows, label), from DuckDB: the log's
    files of these models since ``since`` joined with the tenant's labels received since then
    (less ``LABEL_LEAD``), loaded as an Arrow table."""
    store = log_store()
    files = store.files(PREDICTIONS, tenant_id, model_ids, start=since)
    labels = Feedback.objects.filter(
        tenant_id=tenant_id, received_at__gte=since - LABEL_LEAD
    ).values_list("request_id", "label")
    ids, texts = [], []
    for request_id, label in labels.iterator(chunk_size=5000):
        ids.append(request_id)
        texts.append(orjson.dumps(label).decode())
    feedback = pa.table({"request_id": pa.array(ids, pa.string()), "label": texts})
    where = "status = 200 AND created_at >= ?"
    if version_ids is not None:
        where += f" AND version_id IN ({', '.join(str(int(v)) for v in version_ids) or 'NULL'})"
    with store.connect(PREDICTIONS, files) as con:
        view(con, "feedback", feedback)
        columns = set(view_columns(con))
        score_rows = [OUTPUT + n for n in dict.fromkeys(score_names) if n and OUTPUT + n in columns]
        rows_of = (
            "CASE "
            + " ".join(f"WHEN {quote(c)} IS NOT NULL THEN {quote(c)}" for c in score_rows)
            + " END"
            if score_rows
            else "NULL"
        )
        counts = con.sql(
            f"SELECT date_trunc('hour', created_at) AS hour, version_id, arm, count(*) AS n "
            f"FROM log WHERE {where} GROUP BY ALL",
            params=[since],
        ).to_arrow_table()
        labelled = con.sql(
            f"SELECT l.version_id, l.arm, l.created_at, l.scores, {rows_of} AS score_rows, "
            f"f.label FROM log l JOIN feedback f USING (request_id) WHERE {where}",
            params=[since],
        ).to_arrow_table()
    return counts, labelled


def _tally_rows(
    labelled: pa.Table, task_of: dict[int, str], key_of: Any
) -> dict[Any, LabelledGroup]:
    tallies: dict[Any, LabelledGroup] = defaultdict(LabelledGroup)
    versions = labelled["version_id"].to_pylist()
    arms = labelled["arm"].to_pylist()
    times = labelled["created_at"].to_pylist()
    scores = column_lists(labelled["scores"])
    rows_of = labelled["score_rows"]
    score_rows = column_lists(rows_of) if pa.types.is_list(rows_of.type) else [None] * len(arms)
    labels = labelled["label"].to_pylist()
    for i, version_id in enumerate(versions):
        task = task_of[version_id]
        rows = score_rows[i] if task == TaskKind.CLASSIFIER else None
        tallies[key_of(times[i], version_id, arms[i] or "")].add(
            task, scores[i] or [], rows, orjson.loads(labels[i])
        )
    return tallies


def _bucket_start(at: datetime, bucket: str) -> datetime:
    at = at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return at.replace(hour=0) if bucket == "day" else at


def online_quality(
    tenant_id: int, model: Model, since: datetime, bucket: str = "hour"
) -> list[dict[str, Any]]:
    """Per version, arm and time bucket (by prediction time, UTC) since ``since``: successful
    requests logged, how many of them are labelled, the rows those labels cover, and the
    quality metrics over those rows. Sorted by bucket, version, arm."""
    if bucket not in BUCKETS:
        raise ValueError(f"bucket must be one of {BUCKETS}")
    if model.tenant_id != tenant_id:
        return []
    versions = list(ModelVersion.objects.filter(model=model).select_related("model"))
    number = {v.pk: v.version for v in versions}
    task_of = {v.pk: model.task for v in versions}
    counts, labelled = _labelled_window(
        tenant_id, [model.pk], since, _score_names(versions).values()
    )
    labelled = labelled.filter(pc.is_in(labelled["version_id"], pa.array(list(number))))

    def key(at: datetime, version_id: int, arm: str) -> tuple[datetime, int, str]:
        return (_bucket_start(at, bucket), version_id, arm)

    tallies = _tally_rows(labelled, task_of, key)
    for hour, version_id, arm, n in zip(
        counts["hour"].to_pylist(),
        counts["version_id"].to_pylist(),
        counts["arm"].to_pylist(),
        counts["n"].to_pylist(),
        strict=True,
    ):
        if version_id in number:
            tallies[key(hour, version_id, arm or "")].logged += n
    return [
        {
            "bucket_start": start,
            "version": number[version_id],
            "arm": arm,
            **tallies[(start, version_id, arm)].metrics(model.task),
        }
        for start, version_id, arm in sorted(tallies, key=lambda k: (k[0], number[k[1]], k[2]))
    ]


def quality_by_version(version_ids: Sequence[int], since: datetime) -> dict[int, dict[str, Any]]:
    """Online quality of each version since ``since``, all arms together: the counts of
    ``online_quality`` with accuracy and AUC (classifiers) or MAE (regressors). For rollout
    guardrails and A/B evidence; callers pass versions they already looked up within the
    tenant."""
    versions = list(ModelVersion.objects.filter(pk__in=version_ids).select_related("model"))
    task_of = {v.pk: v.model.task for v in versions}
    tallies: dict[Any, LabelledGroup] = defaultdict(LabelledGroup)
    by_model: dict[tuple[int, int], list[ModelVersion]] = defaultdict(list)
    for v in versions:
        by_model[(v.model.tenant_id, v.model_id)].append(v)
    for (tenant_id, model_id), own in by_model.items():
        counts, labelled = _labelled_window(
            tenant_id,
            [model_id],
            since,
            _score_names(own).values(),
            version_ids=[v.pk for v in own],
        )
        tallies.update(_tally_rows(labelled, task_of, lambda at, version_id, arm: version_id))
        for version_id, n in zip(
            counts["version_id"].to_pylist(), counts["n"].to_pylist(), strict=True
        ):
            tallies[version_id].logged += n
    return {v.pk: tallies[v.pk].metrics(v.model.task) for v in versions}
