"""The prediction log's writer: a sample of requests recorded off the request path.

``PredictionLogger.offer`` runs on the event loop after each prediction: it samples and, for a
sampled request, appends the request's own tensors (no copy, no conversion) to a bounded buffer.
A daemon thread turns them into Arrow columns straight from the stacked tensors (numeric
features and outputs typed, the rest JSON; personal fields redacted or hashed) and writes one
Parquet file per tenant, model and hour on each flush (``monitoring.logstore``). Neither ever
holds up a request. A batch the storage does not take (down, stalled, timed out) stays in the
buffer and is written again after a backoff, file by file, each under the name it was given, so
a stall loses nothing while the buffer lasts and writes nothing twice; what is dropped (offered
to a full buffer, or a record that cannot be written at all) is counted by reason.
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
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

import numpy as np
import orjson
import pyarrow as pa
from django.conf import settings
from prometheus_client import Counter

from monitoring.logstore import LogStore, Piece, log_store
from monitoring.prediction_log import (
    FEATURE,
    OUTPUT,
    PREDICTIONS,
    SCHEMA,
    UTC_MICROS,
    jsonable,
    list_column,
    matrix_column,
    records_table,
    row_scores,
    score_array,
    score_output,
    typed_values,
    value_type_of,
)

from .metrics import PREDLOG_RECORDS, PREDLOG_RETRIES
from .routes import Route

log = logging.getLogger(__name__)


# Children made once: a drop on the request path costs an increment, not a label lookup; and
# every outcome is exported (at 0) before it first happens.
class Counters(NamedTuple):
    """A log writer's Prometheus counters, one child per outcome."""

    written: Any
    dropped_buffer_full: Any
    dropped_unrecordable: Any
    dropped_rejected: Any
    dropped_at_shutdown: Any
    retries: Any

    @classmethod
    def of(cls, records: Counter, retries: Counter) -> Counters:
        outcome = records.labels
        return cls(
            outcome("written"),
            outcome("dropped_buffer_full"),
            outcome("dropped_unrecordable"),
            outcome("dropped_rejected"),
            outcome("dropped_at_shutdown"),
            retries,
        )


PREDICTION_COUNTERS = Counters.of(PREDLOG_RECORDS, PREDLOG_RETRIES)
REDACTED = "[redacted]"
JOIN_TIMEOUT_S = 10.0  # at shutdown, the longest wait for the write under way
# Waits between tries of a batch the storage did not take: doubling from the first to the
# cap, so a storage that comes back is written to within RETRY_MAX_S, and one that stays down
# costs the writer a try every RETRY_MAX_S.
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
# Errors of the storage, not of the rows: the same file may well be taken on the next try
# (pyarrow raises OSError for a refused connection, a timeout, a full disk). Any other error
# is the rows' own (Arrow cannot write them) and is not retried.
TRANSIENT = (OSError,)

Record = dict[str, Any]  # one logged request in the JSON form (``records_table``'s)


def _shape_only(a: np.ndarray) -> dict[str, Any]:
    return {"shape": list(a.shape), "dtype": str(a.dtype)}


def input_columns(
    route: Route, names: Sequence[str], arrays: Sequence[np.ndarray], hash_key: bytes
) -> dict[str, Any]:
    """{column: [value per row]}: a 2-D input with the version's feature names gives one column
    per feature, else ``input[j]``; a 1-D or [n,1] input one column named by the input; higher
    ranks (images, sequences) only their shape. Personal fields, named by feature or by input,
    are redacted or replaced by a keyed hash first."""
    personal = dict(route.personal_fields)
    columns: dict[str, Any] = {}
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
            own = dict(zip(labels, jsonable(array.T), strict=True))
        else:
            own = {name: jsonable(array.reshape(-1))}
        if personal:
            for label, values in own.items():
                rule = personal.get(label) or personal.get(name)
                own[label] = _protect(values, rule, hash_key)
        columns.update(own)
    return columns


def _protect(values: list[Any], rule: str | None, hash_key: bytes) -> list[Any]:
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
    configured = settings.SWITCHYARD_LOG_HASH_KEY
    if configured:
        return configured.encode()
    # Derived, so a deployment without its own key still hashes with a secret one.
    return hashlib.sha256(b"switchyard.predlog:" + settings.SECRET_KEY.encode()).digest()


def output_columns(outputs: Sequence[tuple[str, np.ndarray]] | None) -> dict[str, Any]:
    return {
        name: _shape_only(np.asarray(a)) if np.ndim(a) > 2 else jsonable(np.asarray(a))
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
) -> Record:
    """One logged request in the JSON form, for a prediction answered now."""
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

    def record(self, hash_key: bytes) -> Record:
        return next(build_records([self], hash_key))


def stack_key(sample: Sample) -> tuple[Any, ...] | None:
    """Samples with equal keys can be built together by ``build_records``: the same route,
    tensor names, and per tensor the dtype and the shape past the rows. None for a sample built
    on its own: a tensor of higher rank or of text, or tensors of differing row counts."""
    # One plain loop: this runs once per sampled request on the writer's thread, and the
    # generator-and-set version of it cost ~4 us of the ~10 us a one-row request takes there.
    outputs = sample.outputs or ()
    key: list[Any] = [id(sample.route), len(sample.names), *sample.names]
    key += [name for name, _ in outputs]
    layout: list[Any] = []
    rows = -1
    for a in (*sample.arrays, *[a for _, a in outputs]):
        if not isinstance(a, np.ndarray):
            return None
        shape = a.shape
        if len(shape) not in (1, 2) or a.dtype.kind not in "biuf":
            return None
        if rows != shape[0]:
            if rows != -1:
                return None
            rows = shape[0]
        layout.append(a.dtype)
        layout.append(shape[1:])
    if rows == -1:
        return None
    return (*key, *layout)


def stacked(
    samples: Sequence[Sample],
) -> tuple[list[np.ndarray], list[tuple[str, np.ndarray]]]:
    """The inputs and named outputs of samples of one ``stack_key``, each tensor's rows
    concatenated in the samples' order (one sample's own, as they are)."""
    first = samples[0]
    if len(samples) == 1:
        return list(first.arrays), list(first.outputs or ())
    arrays = [np.concatenate(c) for c in zip(*(s.arrays for s in samples), strict=True)]
    columns = zip(*([a for _, a in s.outputs or ()] for s in samples), strict=True)
    names = [name for name, _ in first.outputs or ()]
    return arrays, list(zip(names, map(np.concatenate, columns), strict=True))


def build_records(samples: Sequence[Sample], hash_key: bytes) -> Iterator[Record]:
    """The records of one sample, or of several of one ``stack_key`` built from their tensors
    stacked: one numpy pass over all their rows instead of one per sample, which halves the
    writer's CPU per record for one-row requests. Whether a classifier's scores are logits is
    judged over all the rows at once.

    The columns are computed here (where a tensor that cannot be described raises); the
    records come one at a time as they are consumed, so that each dies before the next is made
    (thousands of held records had the garbage collector walking them over and over)."""
    first = samples[0]
    route = first.route
    arrays, outputs = stacked(samples)
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


def _sliced(
    samples: Sequence[Sample], inputs: dict[str, Any], outputs: dict[str, Any], scores: list[Any]
) -> Iterator[Record]:
    """Each sample's record: its rows of the stacked columns."""
    end = 0
    for sample in samples:
        start, end = end, end + len(sample.arrays[0])
        yield _fields(sample) | {
            "inputs": {column: values[start:end] for column, values in inputs.items()},
            "outputs": {name: values[start:end] for name, values in outputs.items()},
            "scores": scores[start:end],
        }


def _fields(sample: Sample) -> Record:
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


class PredictionLogger:
    """One per gateway process: samples predictions into a bounded buffer that a daemon
    thread writes in batches. Counts are plain attributes (for tests) and Prometheus counters.

    Offers come from the event loop's thread, so the buffer's length check and append do not
    race; the writer thread is the only one taking from it. The buffer holds the requests'
    arrays as they are (nothing mutates them once answered): converting them to JSON columns is
    the writer's work, so a sampled request costs the event loop an append, not ~15-50 us of
    numpy calls and small allocations.

    A batch leaves the buffer only once it is written: while the storage does not take it,
    it stays at the head and counts against the capacity, so a stall is bounded in memory and
    loses nothing until the buffer is full; from then on offers are refused (and counted).
    """

    thread_name = "prediction-log"
    what = "prediction log"  # in its log messages
    counters = PREDICTION_COUNTERS

    def __init__(
        self,
        capacity: int | None = None,
        batch_size: int | None = None,
        flush_s: float | None = None,
        autostart: bool = True,
    ) -> None:
        """``autostart=False`` leaves the writer thread unstarted: tests then write with
        ``write_pending()`` in their own thread."""
        self.capacity = capacity or settings.SWITCHYARD_PREDLOG_BUFFER
        self.batch_size = batch_size or settings.SWITCHYARD_PREDLOG_BATCH
        self.flush_s = flush_s or settings.SWITCHYARD_PREDLOG_FLUSH_S
        self.hash_key = log_hash_key()
        self.written = 0
        self.dropped_buffer_full = 0
        self.dropped_unrecordable = 0
        self.dropped_rejected = 0
        self.dropped_at_shutdown = 0
        self.retries = 0  # batches the storage did not take, kept to be written again
        self._buffer: deque[Sample] = deque()
        self._pending: Pending | None = None  # the head batch, built, while the storage stalls
        self._accepted = 0  # records put in the buffer, ever
        self._settled = 0  # of those, written or dropped by the writer
        self._wake = threading.Event()
        self._closed = threading.Event()
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
        if self._full():
            return False
        # Tuples, not the request's lists: a tuple of strings and arrays (which the garbage
        # collector does not track) drops out of its walks after the first, while thousands of
        # buffered lists were walked again by every collection (measured: 9 us an offer with
        # 20,000 buffered, 1.3 us without the walks).
        sample = Sample(
            route,
            arm,
            request_id,
            trace_id,
            tuple(names),
            tuple(arrays),
            tuple(outputs) if outputs is not None else None,
            latency_s,
            status,
            time.time(),
        )
        return self._append(sample)

    def _full(self) -> bool:
        if len(self._buffer) < self.capacity:
            return False
        self.dropped_buffer_full += 1
        self.counters.dropped_buffer_full.inc()
        return True

    def _append(self, sample: Any) -> bool:
        """Put a sample in the buffer (room checked), waking the writer at a batch's worth."""
        self._buffer.append(sample)
        self._accepted += 1
        if self._thread is None and self._autostart:
            self._start()
        if len(self._buffer) >= self.batch_size and not self._wake.is_set():
            self._wake.set()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Write (or drop) everything offered so far; False if that took past ``timeout``
        (a storage still down: what is left stays in the buffer, retried)."""
        target = self._accepted
        if self._settled >= target:
            return True
        if self._thread is None:
            self._start()
        self._wake.set()
        with self._progress:
            return self._progress.wait_for(lambda: self._settled >= target, timeout)

    def close(self, timeout: float) -> int:
        """At shutdown: write what is buffered, waiting up to ``timeout``, and stop the writer.
        What the storage still has not taken is lost with the process: returns that number,
        counted (in multiprocess mode the count outlives the process) and logged."""
        self.flush(timeout)
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)  # at most the try under way
        lost = len(self._buffer)
        if lost:
            self.dropped_at_shutdown += lost
            self.counters.dropped_at_shutdown.inc(lost)
            log.warning("%s: %d records not written at shutdown", self.what, lost)
        return lost

    @property
    def pending(self) -> int:
        return len(self._buffer)

    @property
    def dropped(self) -> int:
        return (
            self.dropped_buffer_full
            + self.dropped_unrecordable
            + self.dropped_rejected
            + self.dropped_at_shutdown
        )

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = 0.0
        while not self._closed.is_set():
            if backoff:
                # Not the wake event: under a stall the buffer stays past a batch, and every
                # offer would cut the wait short.
                self._closed.wait(backoff)
            else:
                self._wake.wait(self.flush_s)
                self._wake.clear()
            if self._closed.is_set():
                return
            backoff = 0.0 if self.write_pending() else retry_delay(backoff)

    def write_pending(self) -> bool:
        """Build and write the buffer's records in batches, oldest first (the writer thread's
        one step). False when the storage did not take a batch: it stays at the head of the
        buffer for the next step, already built."""
        while self._buffer:
            pending = self._pending
            count = pending.samples if pending else min(self.batch_size, len(self._buffer))
            # Read, not taken, and by index: offers append on the other end meanwhile, which
            # an iterator over the deque would fail on.
            batch = [self._buffer[i] for i in range(count)]
            if not self._write(batch):
                return False
            for _ in range(count):
                self._buffer.popleft()
            with self._progress:
                self._settled += count
                self._progress.notify_all()
        return True

    def _write(self, batch: list[Sample]) -> bool:
        """Write a batch, one file per partition; False when the storage did not take one of
        them (the files written stay written; the rest are tried again, under their names)."""
        if self._pending is None:
            self._pending = self._build(batch)
        pending = self._pending
        while pending.pieces:
            piece = pending.pieces[0]
            try:
                pending.store.put(piece)
            except TRANSIENT as exc:
                self._failed(sum(p.table.num_rows for p in pending.pieces), exc)
                return False
            except Exception:
                log.exception("%s: the storage refused %d records", self.what, piece.table.num_rows)
                self.dropped_rejected += piece.table.num_rows
                self.counters.dropped_rejected.inc(piece.table.num_rows)
            else:
                self._count_written(piece.table.num_rows)
            pending.pieces.pop(0)
        self._pending = None
        return True

    def _build(self, batch: list[Sample]) -> Pending:
        store = log_store()
        unrecordable: list[Sample] = []
        table = batch_table(batch, self.hash_key, unrecordable)
        self._drop_unrecordable(len(unrecordable))
        return Pending(len(batch), store, store.split(PREDICTIONS, table) if table else [])

    def _failed(self, n: int, exc: Exception) -> None:
        log.warning("%s: %d records kept to retry: %s", self.what, n, exc)
        self.retries += 1
        self.counters.retries.inc()

    def _drop_unrecordable(self, n: int) -> None:
        if n:
            self.dropped_unrecordable += n
            self.counters.dropped_unrecordable.inc(n)

    def _count_written(self, n: int) -> None:
        if n:
            self.written += n
            self.counters.written.inc(n)


class Pending(NamedTuple):
    """A batch built and partly written: ``samples`` from the head of the buffer, and the
    files of it that the storage has not yet taken."""

    samples: int
    store: LogStore
    pieces: list[Piece]


def retry_delay(previous: float) -> float:
    """The wait before the next try of a batch: doubling, from RETRY_FIRST_S to RETRY_MAX_S."""
    return min(RETRY_MAX_S, max(RETRY_FIRST_S, previous * 2))


# Arrow columns straight from the tensors -------------------------------------------------------


def batch_table(
    batch: Sequence[Sample], hash_key: bytes, unrecordable: list[Sample]
) -> pa.Table | None:
    """The log rows of a batch as one table (None when none can be recorded). Samples that
    stack are built together from their tensors; the rest, and a group that fails, one by one
    through their records, so that a tensor we cannot describe loses its own row (put in
    ``unrecordable``), not the batch."""
    groups: dict[tuple[Any, ...] | None, list[Sample]] = {}
    for sample in batch:
        groups.setdefault(stack_key(sample), []).append(sample)
    tables: list[pa.Table] = []
    records: list[tuple[Record, Sample]] = []
    for key, samples in groups.items():
        if key is not None:
            try:
                tables.append(build_table(samples, hash_key))
                continue
            except Exception:
                log.debug("prediction log: building %d records one by one", len(samples))
        for sample in samples:
            try:
                records.append((sample.record(hash_key), sample))
            except Exception:
                log.exception("prediction log: could not record request %s", sample.request_id)
                unrecordable.append(sample)
    if records:
        try:
            tables.append(records_table([r for r, _ in records]))
        except Exception:
            for record, sample in records:  # find the record Arrow cannot take
                try:
                    tables.append(records_table([record]))
                except Exception:
                    log.exception(
                        "prediction log: could not record request %s", record["request_id"]
                    )
                    unrecordable.append(sample)
    if not tables:
        return None
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")


def build_table(samples: Sequence[Sample], hash_key: bytes) -> pa.Table:
    """The log rows of samples of one ``stack_key``, from their tensors stacked: each numeric
    feature and output is one numpy array cut into lists by the requests' row offsets, with no
    Python per row; only what stays JSON (text, booleans, personal fields) is written per
    request. Equal, read back, to each sample's ``record`` (tests/test_predlog.py)."""
    first = samples[0]
    route = first.route
    n = len(samples)
    arrays, outputs = stacked(samples)
    lengths = np.fromiter((len(s.arrays[0]) for s in samples), np.int32, n)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    fields = list(zip(*samples, strict=True))  # per field of Sample, its values (in C)
    at = np.asarray(fields[9], dtype=np.float64)
    columns: dict[str, Any] = {
        "tenant_id": np.full(n, route.tenant_id, np.int64),
        "model_id": np.full(n, route.model_id, np.int64),
        "version_id": np.full(n, route.version_id, np.int64),
        "arm": [arm or "" for arm in fields[1]],
        "request_id": [rid[:128] for rid in fields[2]],
        "trace_id": [tid[:32] for tid in fields[3]],
        "created_at": pa.array((at * 1e6).astype(np.int64), type=UTC_MICROS),
        "latency_ms": np.asarray(fields[7], dtype=np.float64) * 1000.0,
        "status": np.asarray(fields[8], dtype=np.int32),
        "rows": lengths,
    }
    typed: dict[str, pa.Array] = {}
    leftover_in: dict[str, list[Any]] = {}
    for label, column, rule in _input_arrays(route, first.names, arrays):
        kind = value_type_of(column.dtype)
        if rule is None and kind is not None:
            typed[FEATURE + label] = list_column(offsets, typed_values(column, kind))
        else:
            leftover_in[label] = _protect(jsonable(column), rule, hash_key)
    leftover_out: dict[str, list[Any]] = {}
    for name, a in outputs:
        kind = value_type_of(a.dtype)
        if kind is not None and a.ndim == 1:
            typed[OUTPUT + name] = list_column(offsets, typed_values(a, kind))
        elif kind is not None and a.ndim == 2:
            typed[OUTPUT + name] = matrix_column(offsets, a, kind)
        else:
            leftover_out[name] = jsonable(a)
    columns["inputs"] = _json_per_request(leftover_in, offsets)
    columns["outputs"] = _json_per_request(leftover_out, offsets)
    by_name = dict(outputs)
    score_name = score_output(route.task, route.outputs)
    scores = score_array(route.task, by_name[score_name]) if score_name in by_name else None
    if scores is None or len(scores) != offsets[-1]:
        scores = np.zeros(0)
        offsets = np.zeros(n + 1, np.int32)  # every request's scores: []
    kind = value_type_of(scores.dtype) or pa.float64()
    columns["scores"] = list_column(offsets, typed_values(scores, kind))
    table = pa.table(
        {name: pa.array(columns[name], type=SCHEMA.field(name).type) for name in SCHEMA.names[:-1]}
    )
    table = table.append_column("scores", columns["scores"])
    for name, column in typed.items():
        table = table.append_column(name, column)
    return table


def _input_arrays(
    route: Route, names: Sequence[str], arrays: Sequence[np.ndarray]
) -> Iterator[tuple[str, np.ndarray, str | None]]:
    """(column label, values per row, personal rule) of each logged input column, labelled as
    ``input_columns`` labels them (stackable inputs are of rank 1 or 2)."""
    personal = dict(route.personal_fields)
    for name, array in zip(names, arrays, strict=False):
        if array.ndim == 2 and array.shape[1] != 1:
            width = array.shape[1]
            labels = (
                route.feature_names
                if len(route.feature_names) == width
                else [f"{name}[{j}]" for j in range(width)]
            )
            for j, label in enumerate(labels):
                yield label, array[:, j], personal.get(label) or personal.get(name)
        else:
            yield name, array.reshape(-1), personal.get(name)


def _json_per_request(columns: dict[str, list[Any]], offsets: np.ndarray) -> list[str | None]:
    n = len(offsets) - 1
    if not columns:
        return [None] * n
    bounds = offsets.tolist()
    return [
        orjson.dumps({k: v[bounds[i] : bounds[i + 1]] for k, v in columns.items()}).decode()
        for i in range(n)
    ]
