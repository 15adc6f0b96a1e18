"""Ground truth and online quality: feedback labels joined to logged predictions by request id.

Labels may arrive before the prediction's log row is written or days after; the join happens
when quality is computed, so neither order loses anything. Classifiers get accuracy (the
predicted class: score ≥ 0.5 for binary models, the top class otherwise) and, for binary ones,
AUC; regressors the mean absolute error.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import numpy as np
from django.db.models import Count, Exists, OuterRef, QuerySet, Subquery
from django.db.models.functions import Trunc
from django.utils import timezone

from registry.models import Model, ModelVersion, TaskKind

from .models import Feedback, PredictionLog
from .prediction_log import score_output

BUCKETS = ("hour", "day")
MAX_FEEDBACK_ITEMS = 10_000
_IN_CHUNK = 1000  # ids per IN (...) list, well inside every backend's parameter limit


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
    ids = list(labels)
    matched = 0
    for start in range(0, len(ids), _IN_CHUNK):
        matched += (
            PredictionLog.objects.filter(
                tenant_id=tenant_id, request_id__in=ids[start : start + _IN_CHUNK]
            )
            .order_by()
            .values("request_id")
            .distinct()
            .count()
        )
    return len(rows), matched


def _label_of_request() -> Subquery:
    """The feedback label of a log row's request, within the row's own tenant."""
    same = Feedback.objects.filter(
        tenant_id=OuterRef("tenant_id"), request_id=OuterRef("request_id")
    )
    return Subquery(same.values("label")[:1])


def logged_predictions(
    model: Model,
    *,
    version: int | None = None,
    status: int | None = None,
    request_id: str | None = None,
) -> QuerySet[PredictionLog]:
    """A model's log rows, newest first, each with ``label`` (None without feedback)."""
    rows = PredictionLog.objects.filter(model=model).select_related("version")
    if version is not None:
        rows = rows.filter(version__version=version)
    if status is not None:
        rows = rows.filter(status=status)
    if request_id:
        rows = rows.filter(request_id=request_id)
    return rows.annotate(label=_label_of_request()).order_by("-created_at", "-pk")


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


_K = TypeVar("_K", bound=Hashable)  # what requests are grouped by


def _tally(
    logs: QuerySet[PredictionLog],
    task_of: dict[int, str],
    score_names: dict[int, str | None],
    key: Callable[[dict[str, Any]], _K],
) -> dict[_K, LabelledGroup]:
    """Tallies of ``logs``' successful, labelled requests grouped by ``key(row)``."""
    tallies: dict[_K, LabelledGroup] = defaultdict(LabelledGroup)
    has_label = Exists(
        Feedback.objects.filter(tenant_id=OuterRef("tenant_id"), request_id=OuterRef("request_id"))
    )
    rows = (
        logs.filter(has_label, status=200)
        .annotate(label=_label_of_request())
        .values("version_id", "arm", "created_at", "scores", "outputs", "label")
        .order_by()
    )
    for row in rows.iterator(chunk_size=2000):
        version_id = row["version_id"]
        task = task_of[version_id]
        name = score_names.get(version_id)
        score_rows = row["outputs"].get(name) if task == TaskKind.CLASSIFIER and name else None
        tallies[key(row)].add(task, row["scores"], score_rows, row["label"])
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
    logs = PredictionLog.objects.filter(tenant_id=tenant_id, model=model, created_at__gte=since)
    versions = list(ModelVersion.objects.filter(model=model).select_related("model"))
    number = {v.pk: v.version for v in versions}
    task_of = {v.pk: model.task for v in versions}

    def key(row: dict[str, Any]) -> tuple[datetime, int, str]:
        return (_bucket_start(row["created_at"], bucket), row["version_id"], row["arm"])

    tallies = _tally(logs, task_of, _score_names(versions), key)
    counts = (
        logs.filter(status=200)
        .order_by()
        .annotate(start=Trunc("created_at", bucket, tzinfo=UTC))
        .values("start", "version_id", "arm")
        .annotate(n=Count("pk"))
    )
    for row in counts:
        tallies[(row["start"].astimezone(UTC), row["version_id"], row["arm"])].logged = row["n"]
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
    logs = PredictionLog.objects.filter(version_id__in=task_of, created_at__gte=since)
    tallies = _tally(logs, task_of, _score_names(versions), lambda row: row["version_id"])
    counts = logs.filter(status=200).order_by().values("version_id").annotate(n=Count("pk"))
    for row in counts:
        tallies[row["version_id"]].logged = row["n"]
    return {v.pk: tallies[v.pk].metrics(v.model.task) for v in versions}
