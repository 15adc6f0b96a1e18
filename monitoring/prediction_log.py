"""The prediction log's format, shared by its writer (``gateway.predlog``, in every gateway
process) and its readers (drift, quality, the API and pages): how tensors become JSON values,
which output gives a row's score, and how long rows are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import orjson
from django.db.models import Max, QuerySet
from django.utils import timezone

from registry.models import Model, TaskKind

from .models import Feedback, PredictionLog

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
    source = np.asarray(array)
    a = source.astype(np.float64)
    if a.ndim < 2:
        a = a.reshape(-1, 1)
    if a.ndim > 2 or task not in (TaskKind.CLASSIFIER, TaskKind.REGRESSOR):
        return []
    if task == TaskKind.REGRESSOR:
        scores = a[:, 0] if a.shape[1] == 1 else None
    else:
        probs = _probabilities(a)
        if probs.shape[1] == 1:
            scores = probs[:, 0]
        else:
            scores = probs[:, 1] if probs.shape[1] == 2 else probs.max(axis=1)
    if scores is None:
        return []
    if source.dtype.kind == "f" and source.dtype.itemsize < 8:
        scores = scores.astype(source.dtype)  # the model's precision: its 0.1 is logged as 0.1
    return jsonable(scores)


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


def purge_expired_logs(now: datetime | None = None) -> dict[str, int]:
    """Delete each model's log rows older than its ``log_retention_days``, and feedback older
    than the longest retention of its tenant's models; in chunks, so no delete holds a long
    lock. Returns the counts deleted."""
    now = now or timezone.now()
    logs = 0
    for model_id, days in Model.objects.values_list("pk", "log_retention_days"):
        expired = PredictionLog.objects.filter(
            model_id=model_id, created_at__lt=now - timedelta(days=days)
        )
        logs += _delete_in_chunks(expired)
    longest = dict(
        Model.objects.order_by()
        .values("tenant_id")
        .annotate(days=Max("log_retention_days"))
        .values_list("tenant_id", "days")
    )
    default_days = Model._meta.get_field("log_retention_days").default
    feedback = 0
    for tenant_id in Feedback.objects.order_by().values_list("tenant_id", flat=True).distinct():
        days = longest.get(tenant_id, default_days)
        stale = Feedback.objects.filter(
            tenant_id=tenant_id, received_at__lt=now - timedelta(days=days)
        )
        feedback += _delete_in_chunks(stale)
    return {"prediction_logs": logs, "feedback": feedback}


def _delete_in_chunks(rows: QuerySet[Any]) -> int:
    total = 0
    while True:
        ids = list(rows.order_by().values_list("pk", flat=True)[:PURGE_CHUNK])
        if not ids:
            return total
        total += rows.model.objects.filter(pk__in=ids).delete()[0]
