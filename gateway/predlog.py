"""The prediction log: a sample of requests recorded off the request path, and its retention.

``PredictionLogger.offer`` runs on the event loop after each prediction: it samples and, for a
sampled request, appends the request's own tensors (no copy, no conversion) to a bounded buffer.
A daemon thread turns them into JSON columns (personal fields redacted or hashed) and writes them
in batches. Neither ever holds up a request: a full buffer or a failed write drops records and
counts them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import numpy as np
import orjson
from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import Max, QuerySet
from django.utils import timezone
from prometheus_client import Counter

from registry.models import Model, TaskKind

from .models import Feedback, PredictionLog
from .routes import Route

log = logging.getLogger(__name__)

RECORDS = Counter(
    "switchyard_prediction_log_records",
    "Sampled predictions by what became of them: written, or dropped (buffer full, write failed).",
    ["outcome"],
)
# Children made once: a drop on the request path costs an increment, not a label lookup; and
# every outcome is exported (at 0) before it first happens.
WRITTEN = RECORDS.labels("written")
DROPPED_BUFFER_FULL = RECORDS.labels("dropped_buffer_full")
DROPPED_WRITE_FAILED = RECORDS.labels("dropped_write_failed")
REDACTED = "[redacted]"
FLOAT_TYPES = {"FP16", "FP32", "FP64", "BF16"}
NUMPY = orjson.OPT_SERIALIZE_NUMPY
PURGE_CHUNK = 5000
WRITE_TIMEOUT_MS = 5000  # a batch write slower than this on PostgreSQL is dropped (counted)


def score_output(task: str, outputs: Sequence[dict]) -> str | None:
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
    return _jsonable(scores)


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


def _finite_list(a: np.ndarray) -> list:
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


def _jsonable(a: np.ndarray) -> list:
    if a.dtype.kind in "OS":  # BYTES tensors
        return np.vectorize(_text, otypes=[object])(a).tolist() if a.size else a.tolist()
    try:
        # orjson writes a float32 as its shortest text (0.3, where tolist() gives
        # 0.30000001192092896: 40 % more bytes to send and for PostgreSQL to parse), and NaN and
        # infinities as null.
        return orjson.loads(orjson.dumps(np.ascontiguousarray(a), option=NUMPY))
    except TypeError:  # a dtype orjson does not take (complex numbers, strings)
        return _finite_list(a)


def _shape_only(a: np.ndarray) -> dict:
    return {"shape": list(a.shape), "dtype": str(a.dtype)}


def input_columns(
    route: Route, names: Sequence[str], arrays: Sequence[np.ndarray], hash_key: bytes
) -> dict:
    """{column: [value per row]}: a 2-D input with the version's feature names gives one column
    per feature, else ``input[j]``; a 1-D or [n,1] input one column named by the input; higher
    ranks (images, sequences) only their shape. Personal fields, named by feature or by input,
    are redacted or replaced by a keyed hash first."""
    personal = dict(route.personal_fields)
    columns: dict = {}
    for name, array in zip(names, arrays, strict=False):
        array = np.asarray(array)
        if array.ndim > 2:
            columns[name] = _shape_only(array)
            continue
        if array.ndim == 2 and array.shape[1] != 1:
            width = array.shape[1]
            labels = (
                route.feature_names
                if len(route.feature_names) == width
                else [f"{name}[{j}]" for j in range(width)]
            )
            own = dict(zip(labels, _jsonable(array.T), strict=True))
        else:
            own = {name: _jsonable(array.reshape(-1))}
        if personal:
            for label, values in own.items():
                rule = personal.get(label) or personal.get(name)
                own[label] = _protect(values, rule, hash_key)
        columns.update(own)
    return columns


def _protect(values: list, rule: str | None, hash_key: bytes) -> list:
    if rule == "redact":
        return [REDACTED] * len(values)
    if rule == "hash":
        return [keyed_hash(v, hash_key) for v in values]
    return values


def keyed_hash(value: object, key: bytes) -> str:
    """HMAC-SHA256 of the value: equal values hash equal (joins still work), yet without the
    key the value cannot be guessed by hashing candidates."""
    text = value if isinstance(value, str) else json.dumps(value)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def log_hash_key() -> bytes:
    configured = settings.SWITCHYARD["LOG_HASH_KEY"]
    if configured:
        return configured.encode()
    # Derived, so a deployment without its own key still hashes with a secret one.
    return hashlib.sha256(b"switchyard.predlog:" + settings.SECRET_KEY.encode()).digest()


def output_columns(outputs: Sequence[tuple[str, np.ndarray]] | None) -> dict:
    return {
        name: _shape_only(np.asarray(a)) if np.ndim(a) > 2 else _jsonable(np.asarray(a))
        for name, a in outputs or ()
    }


def build_record(
    route: Route,
    *,
    arm: str | None,
    request_id: str,
    trace_id: str,
    names: Sequence[str],
    arrays: Sequence[np.ndarray],
    outputs: Sequence[tuple[str, np.ndarray]] | None,
    latency_s: float,
    status: int,
    hash_key: bytes,
) -> dict:
    """The fields of one ``PredictionLog`` row, for a prediction answered now."""
    sample = Sample(
        route, arm, request_id, trace_id, names, arrays, outputs, latency_s, status, time.time()
    )
    return sample.record(hash_key)


class Sample(NamedTuple):
    """A sampled prediction as the request left it: what ``build_record`` needs, unconverted."""

    route: Route
    arm: str | None
    request_id: str
    trace_id: str
    names: Sequence[str]
    arrays: Sequence[np.ndarray]
    outputs: Sequence[tuple[str, np.ndarray]] | None
    latency_s: float
    status: int
    at: float  # time.time() when answered

    def record(self, hash_key: bytes) -> dict:
        return next(build_records([self], hash_key))


def stack_key(sample: Sample) -> tuple | None:
    """Samples with equal keys can be built together by ``build_records``: the same route,
    tensor names, and per tensor the dtype and the shape past the rows. None for a sample built
    on its own: a tensor of higher rank or of text, or tensors of differing row counts."""
    outputs = sample.outputs or ()
    tensors = [*sample.arrays, *(a for _, a in outputs)]
    stackable = all(
        isinstance(a, np.ndarray) and a.ndim in (1, 2) and a.dtype.kind in "biuf" for a in tensors
    )
    if not tensors or not stackable or len({len(a) for a in tensors}) != 1:
        return None
    return (
        id(sample.route),
        len(sample.names),
        *sample.names,
        *(name for name, _ in outputs),
        *(a.dtype for a in tensors),
        *(a.shape[1:] for a in tensors),
    )


def build_records(samples: Sequence[Sample], hash_key: bytes) -> Iterator[dict]:
    """The records of one sample, or of several of one ``stack_key`` built from their tensors
    stacked: one numpy pass over all their rows instead of one per sample, which halves the
    writer's CPU per record for one-row requests. Whether a classifier's scores are logits is
    judged over all the rows at once.

    The columns are computed here (where a tensor that cannot be described raises); the
    records come one at a time as they are consumed, so that each dies before the next is made
    (thousands of held records had the garbage collector walking them over and over)."""
    first = samples[0]
    route = first.route
    if len(samples) == 1:
        arrays, outputs = list(first.arrays), list(first.outputs or ())
    else:
        arrays = [np.concatenate(c) for c in zip(*(s.arrays for s in samples), strict=True)]
        stacked = zip(*([a for _, a in s.outputs or ()] for s in samples), strict=True)
        names = [name for name, _ in first.outputs or ()]
        outputs = list(zip(names, map(np.concatenate, stacked), strict=True))
    inputs = input_columns(route, first.names, arrays, hash_key)
    output_values = output_columns(outputs)
    by_name = dict(outputs)
    score_name = score_output(route.task, route.outputs)
    scores = row_scores(route.task, by_name[score_name]) if score_name in by_name else []
    if len(samples) == 1:
        return iter(
            [_fields(first) | {"inputs": inputs, "outputs": output_values, "scores": scores}]
        )
    return _sliced(samples, inputs, output_values, scores)


def _sliced(samples: Sequence[Sample], inputs: dict, outputs: dict, scores: list) -> Iterator[dict]:
    """Each sample's record: its rows of the stacked columns."""
    end = 0
    for sample in samples:
        start, end = end, end + len(sample.arrays[0])
        yield _fields(sample) | {
            "inputs": {column: values[start:end] for column, values in inputs.items()},
            "outputs": {name: values[start:end] for name, values in outputs.items()},
            "scores": scores[start:end],
        }


def _fields(sample: Sample) -> dict:
    route = sample.route
    return {
        "tenant_id": route.tenant_id,
        "model_id": route.model_id,
        "version_id": route.version_id,
        "arm": sample.arm or "",
        "request_id": sample.request_id[:128],
        "trace_id": sample.trace_id[:32],
        "latency_ms": sample.latency_s * 1000.0,
        "status": sample.status,
        "created_at": datetime.fromtimestamp(sample.at, UTC),
    }


def batch_records(
    batch: Sequence[Sample], hash_key: bytes, unrecordable: list[Sample]
) -> Iterator[dict]:
    """The records of a batch, as the write consumes them. Samples that stack are built
    together; the rest, and a group that fails, one by one, so that a tensor we cannot describe
    loses its own record (put in ``unrecordable``), not the batch."""
    groups: dict[tuple | None, list[Sample]] = {}
    for sample in batch:
        groups.setdefault(stack_key(sample), []).append(sample)
    for key, samples in groups.items():
        if key is not None:
            try:
                together = build_records(samples, hash_key)
            except Exception:
                log.debug("prediction log: building %d records one by one", len(samples))
            else:
                yield from together
                continue
        for sample in samples:
            try:
                yield sample.record(hash_key)
            except Exception:
                log.exception("prediction log: could not record request %s", sample.request_id)
                unrecordable.append(sample)


class PredictionLogger:
    """One per gateway process: samples predictions into a bounded buffer that a daemon
    thread writes in batches. Counts are plain attributes (for tests) and Prometheus counters.

    Offers come from the event loop's thread, so the buffer's length check and append do not
    race; the writer thread is the only one taking from it. The buffer holds the requests'
    arrays as they are (nothing mutates them once answered): converting them to JSON columns is
    the writer's work, so a sampled request costs the event loop an append, not ~15-50 us of
    numpy calls and small allocations.
    """

    def __init__(
        self,
        capacity: int | None = None,
        batch_size: int | None = None,
        flush_s: float | None = None,
        autostart: bool = True,
    ) -> None:
        """``autostart=False`` leaves the writer thread unstarted: tests then write with
        ``write_pending()`` in their own thread."""
        conf = settings.SWITCHYARD
        self.capacity = capacity or conf["PREDLOG_BUFFER"]
        self.batch_size = batch_size or conf["PREDLOG_BATCH"]
        self.flush_s = flush_s or conf["PREDLOG_FLUSH_S"]
        self.hash_key = log_hash_key()
        self.written = 0
        self.dropped_buffer_full = 0
        self.dropped_write_failed = 0
        self._buffer: deque[Sample] = deque()
        self._accepted = 0  # records put in the buffer, ever
        self._settled = 0  # of those, written or dropped by the writer
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._thread: threading.Thread | None = None
        self._autostart = autostart

    def offer(
        self,
        route: Route,
        *,
        arm: str | None,
        request_id: str,
        trace_id: str,
        names: list[str],
        arrays: list[np.ndarray],
        outputs: list[tuple[str, np.ndarray]] | None,
        latency_s: float,
        status: int,
    ) -> bool:
        """Log this prediction if sampled; True if it went into the buffer. Never blocks."""
        if random.random() >= route.log_sample_rate:
            return False
        if len(self._buffer) >= self.capacity:
            self.dropped_buffer_full += 1
            DROPPED_BUFFER_FULL.inc()
            return False
        sample = Sample(
            route, arm, request_id, trace_id, names, arrays, outputs, latency_s, status, time.time()
        )
        self._buffer.append(sample)
        self._accepted += 1
        if self._thread is None and self._autostart:
            self._start()
        if len(self._buffer) >= self.batch_size and not self._wake.is_set():
            self._wake.set()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Write (or drop) everything offered so far; False if that took past ``timeout``."""
        target = self._accepted
        if self._settled >= target:
            return True
        if self._thread is None:
            self._start()
        self._wake.set()
        with self._progress:
            return self._progress.wait_for(lambda: self._settled >= target, timeout)

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prediction-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            self.write_pending()

    def _count_failed(self, n: int) -> None:
        if n:
            self.dropped_write_failed += n
            DROPPED_WRITE_FAILED.inc(n)

    def write_pending(self) -> None:
        """Build and write the buffer's records in batches (the writer thread's one step)."""
        while self._buffer:
            count = min(self.batch_size, len(self._buffer))
            self._write([self._buffer.popleft() for _ in range(count)])

    def _write(self, batch: list[Sample]) -> None:
        unrecordable: list[Sample] = []
        try:
            close_old_connections()  # honour CONN_MAX_AGE and drop connections that broke
            write_batch(batch_records(batch, self.hash_key, unrecordable))
        except Exception as exc:  # database down, locked or slow: losing samples beats stalling
            log.warning("prediction log: dropped %d records: %s", len(batch), exc)
            self._count_failed(len(batch))
            connection.close()  # never reuse a connection left in a failed state
        else:
            self._count_failed(len(unrecordable))
            self.written += len(batch) - len(unrecordable)
            WRITTEN.inc(len(batch) - len(unrecordable))
        with self._progress:
            self._settled += len(batch)
            self._progress.notify_all()


COPY_COLUMNS = (
    "tenant_id",
    "model_id",
    "version_id",
    "arm",
    "request_id",
    "trace_id",
    "inputs",
    "outputs",
    "scores",
    "latency_ms",
    "status",
    "created_at",
)
JSON_COLUMNS = {"inputs", "outputs", "scores"}


def write_batch(records: Iterable[dict]) -> None:
    """Insert one batch of records in a transaction of its own."""
    if connection.vendor == "postgresql":
        copy_rows(records)
    else:
        with transaction.atomic():
            PredictionLog.objects.bulk_create([PredictionLog(**r) for r in records])


def copy_row(record: dict) -> tuple:
    """A record as COPY takes it: the JSON columns as text, the rest as they are."""
    return tuple(
        orjson.dumps(record[c]).decode() if c in JSON_COLUMNS else record[c] for c in COPY_COLUMNS
    )


def copy_rows(records: Iterable[dict]) -> None:
    """Write records with PostgreSQL's COPY. bulk_create's INSERT ... UNNEST escapes every JSON
    document as an array element, measured at ~330 us of CPU a record against ~10 us this way,
    and that CPU is the gateway process's.

    Every row is built before the statement starts, and the COPY runs on its own, in
    autocommit (one statement is one transaction: a failed batch writes nothing): a batch is
    one round trip where BEGIN, settings and COMMIT made it four, and each round trip hands the
    GIL back and forth with the event loop (measured: 1.6 → 0.9 ms of the writer's CPU per
    batch of 30)."""
    rows = [copy_row(r) for r in records]
    table = PredictionLog._meta.db_table
    configure_session()
    with connection.cursor() as cursor:
        with cursor.cursor.copy(f"COPY {table} ({', '.join(COPY_COLUMNS)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)


def configure_session() -> None:
    """Settings for the writer's connection, made once per connection (the thread's own one):
    a hung server must fail a batch, not stall the writer behind it; and a commit need not
    wait for the WAL to reach disk (a database crash may lose the last moment of a sampled
    log, never its consistency)."""
    connection.ensure_connection()
    raw = connection.connection
    if getattr(connection, "predlog_session", None) is raw:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            f"SET statement_timeout = {int(WRITE_TIMEOUT_MS)}; SET synchronous_commit = off"
        )
    connection.predlog_session = raw


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
        expired = Feedback.objects.filter(
            tenant_id=tenant_id, received_at__lt=now - timedelta(days=days)
        )
        feedback += _delete_in_chunks(expired)
    return {"prediction_logs": logs, "feedback": feedback}


def _delete_in_chunks(rows: QuerySet) -> int:
    total = 0
    while True:
        ids = list(rows.order_by().values_list("pk", flat=True)[:PURGE_CHUNK])
        if not ids:
            return total
        total += rows.model.objects.filter(pk__in=ids).delete()[0]
