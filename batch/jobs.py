"""Batch jobs' lifecycle: submission (checked, planned into chunks, given its own key), the
chunk loop the Celery tasks drive (claim, run, complete), pause, resume, cancel, and progress.

Exactly once: a chunk's output file is written to storage before the chunk is marked done, in
one transaction that also counts its rows; a chunk whose worker died (its lease ran out) is
claimed again and redone from scratch into a file of its own attempt, and the final output is
assembled from the done chunks' files in order. So no row is lost or written twice.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import IO, Any

import httpx
import orjson
from django.conf import settings
from django.core.files import File
from django.core.files.storage import default_storage
from django.core.files.uploadedfile import UploadedFile
from django.db import connection, transaction
from django.db.models import F, Q, QuerySet, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from monitoring.budgets import check_budget
from platform_site.errors import Conflict, Invalid, NotFound, TooLarge
from platform_site.jobs import send_on_commit
from registry.access import alias_for, model_for, version_for
from registry.models import ModelVersion
from tenants.audit import SYSTEM, Actor, audit
from tenants.keys import create_derived_key, derive_raw_key, revoke_api_key
from tenants.models import KeyPriority, Scope, Tenant

from .inputs import RowError, Signature, check_input, convert_row, read_rows
from .models import ENDED, Chunk, ChunkState, InputFormat, Job, JobState
from .runner import BudgetStop, GaveUp, Outcome, Sender, Unservable, send_all

STEP_TASK = "batch.tasks.run_next_chunk"
RECENT_CHUNKS = 5  # the chunks the rate is measured over
MAX_ERRORS_SHOWN = 1000


def key_context(job_id: int) -> str:
    """What a job's key is derived from (with SECRET_KEY and the key's prefix)."""
    return f"switchyard-batch-job:{job_id}"


# Lookups ------------------------------------------------------------------------------------


def jobs_of(tenant_id: int) -> QuerySet[Job]:
    return Job.objects.filter(tenant_id=tenant_id).select_related("model", "version")


def job_for(tenant_id: int, job_id: int) -> Job:
    """A job of this tenant; another tenant's job is as unknown as none (404)."""
    job = jobs_of(tenant_id).filter(pk=job_id).first()
    if job is None:
        raise NotFound(f"no batch job {job_id} in this tenant")
    return job


def _target(job: Job) -> str:
    return f"batch job {job.pk} ({job.model.name} v{job.version.version})"


# Submission ---------------------------------------------------------------------------------


def resolve_version(
    tenant_id: int, model_name: str, alias: str | None, version: int | None
) -> ModelVersion:
    """The version a job runs: the one asked for, or the one the alias names now (default
    ``production``); fixed at submission, so a later alias move does not change the job."""
    if alias and version is not None:
        raise Invalid("version", "give an alias or a version, not both")
    model = model_for(tenant_id, model_name)
    if version is not None:
        return version_for(model, version)
    found = alias_for(model, alias or "production").version
    found.model = model
    return found


def submit_job(
    tenant: Tenant,
    actor: Actor,
    model_name: str,
    fmt: str,
    upload: UploadedFile | None = None,
    input_name: str | None = None,
    alias: str | None = None,
    version: int | None = None,
    deadline: datetime | None = None,
) -> Job:
    """A new job, checked (version, format, size, header/columns, rows), planned into chunks,
    given its own derived key and queued; audited as ``job.submit``."""
    if fmt not in InputFormat.values:
        raise Invalid("format", f"must be one of {list(InputFormat.values)}")
    if (upload is None) == (input_name is None):
        raise Invalid("file", "send a file, or the name of an input in storage, not both")
    if deadline is not None and deadline <= timezone.now():
        raise Invalid("deadline", "must be in the future")
    check_budget(tenant.pk)  # a spent budget's hard stop refuses new jobs, as new requests
    found = resolve_version(tenant.pk, model_name, alias, version)
    signature = Signature.of(found)
    if not signature.features or (signature.tabular and len(signature.inputs) != 1):
        raise Invalid("model", "this version's inputs cannot be read from rows of features")
    if input_name is not None:
        input_name = _checked_reference(tenant, input_name)
    size = upload.size if upload is not None else _stored_size(input_name or "")
    limit = int(settings.SWITCHYARD_BATCH_MAX_INPUT_BYTES)
    if (size or 0) > limit:
        raise TooLarge("file", f"the input is larger than {limit} bytes")
    chunk_rows = max(1, int(settings.SWITCHYARD_BATCH_CHUNK_ROWS))
    with _opened(upload, input_name) as fh:
        rows, offsets = check_input(fh, fmt, signature, chunk_rows)
    if rows > int(settings.SWITCHYARD_BATCH_MAX_ROWS):
        raise Invalid("file", f"the input has more than {settings.SWITCHYARD_BATCH_MAX_ROWS} rows")
    with transaction.atomic():
        job = Job.objects.create(
            tenant=tenant,
            model=found.model,
            version=found,
            asked_alias=alias or ("" if version is not None else "production"),
            asked_version=version,
            input_name=input_name or "",
            input_format=fmt,
            rows_total=rows,
            deadline=deadline,
            created_by_id=actor.user_id,
        )
        if upload is not None:
            upload.seek(0)
            job.input_name = default_storage.save(f"{_prefix(job)}input.{fmt}", upload)
        job.api_key = create_derived_key(
            tenant,
            f"batch job {job.pk}",
            key_context(job.pk),
            actor,
            priority=KeyPriority.BATCH,
            scopes=(Scope.PREDICT,),
        )
        job.save(update_fields=["input_name", "api_key"])
        plan_chunks(job, chunk_rows, offsets)
        after = {
            "model": found.model.name,
            "version": found.version,
            "alias": job.asked_alias,
            "format": fmt,
            "rows": rows,
            "input": job.input_name,
            "deadline": deadline.isoformat() if deadline else None,
        }
        audit(tenant.pk, actor, "job.submit", _target(job), after=after)
        _start_workers(job)
    return job


def plan_chunks(job: Job, size: int, offsets: list[int] | None = None) -> list[Chunk]:
    """Chunks of ``size`` rows covering the input once, in order (``offsets``: where each
    begins in a text input)."""
    chunks = [
        Chunk(
            job=job,
            index=i,
            start_row=start,
            end_row=min(start + size, job.rows_total),
            start_byte=offsets[i] if offsets else None,
        )
        for i, start in enumerate(range(0, job.rows_total, size))
    ]
    return Chunk.objects.bulk_create(chunks)


def _prefix(job: Job) -> str:
    return f"batch/{job.tenant_id}/{job.pk}/"


def _checked_reference(tenant: Tenant, name: str) -> str:
    """A name in the platform's storage under the tenant's own input prefix (so one tenant
    cannot run another's files), with no ``..`` or control characters, that exists."""
    prefix = str(settings.SWITCHYARD_BATCH_INPUT_PREFIX).format(tenant=tenant.slug)
    parts = name.split("/")
    if (
        len(name) > 400
        or not name.startswith(prefix)
        or any(p in ("", ".", "..") for p in parts)
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise Invalid("input", f"must be a file name in storage under {prefix!r}")
    if not default_storage.exists(name):
        raise Invalid("input", f"no file {name!r} in storage")
    return name


def _stored_size(name: str) -> int:
    return int(default_storage.size(name))


class _opened:
    """The input as a binary file: the upload itself, or the stored object."""

    def __init__(self, upload: UploadedFile | None, name: str | None) -> None:
        self.upload, self.name = upload, name
        self.fh: Any = None

    def __enter__(self) -> IO[bytes]:
        if self.upload is not None:
            self.upload.seek(0)
            if self.upload.file is None:
                raise Invalid("file", "the upload has no content")
            return self.upload.file
        self.fh = default_storage.open(self.name or "", "rb")
        return self.fh

    def __exit__(self, *exc: object) -> None:
        if self.fh is not None:
            self.fh.close()


def _start_workers(job: Job) -> None:
    """Queue one chunk loop per allowed parallel chunk, once the transaction commits."""
    for _ in range(max(1, int(settings.SWITCHYARD_BATCH_PARALLEL_CHUNKS))):
        send_on_commit(STEP_TASK, job.pk)


# The chunk loop -----------------------------------------------------------------------------


def claim_chunk(job_id: int, now: datetime | None = None) -> Chunk | None:
    """The next chunk of a running (or queued) job for this worker: a pending one, or one whose
    lease ran out (its worker died), leased to the caller; None when the job is not running,
    has its parallel chunks at work, or has none left (then it is finished)."""
    now = now or timezone.now()
    with transaction.atomic():
        # Row lock on the job: two loops (a chunk task and the reaper's) see one count of
        # chunks at work, and a pause or cancel waits for a claim in progress.
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.state not in (JobState.QUEUED, JobState.RUNNING):
            return None
        busy = job.chunks.filter(state=ChunkState.RUNNING, lease_until__gt=now).count()
        if busy >= max(1, int(settings.SWITCHYARD_BATCH_PARALLEL_CHUNKS)):
            return None
        claimable = job.chunks.filter(
            Q(state=ChunkState.PENDING) | Q(state=ChunkState.RUNNING, lease_until__lte=now)
        ).order_by("index")
        chunk = _locked(claimable).first()
        if chunk is None:
            if busy == 0:
                send_on_commit("batch.tasks.finish_job", job.pk)
            return None
        if chunk.attempts >= int(settings.SWITCHYARD_BATCH_MAX_ATTEMPTS):
            _fail(job, f"chunk {chunk.index} failed {chunk.attempts} times; last: lease ran out")
            return None
        chunk.state = ChunkState.RUNNING
        chunk.attempts += 1
        chunk.claimed_at = now
        chunk.lease_until = now + timedelta(seconds=float(settings.SWITCHYARD_BATCH_LEASE_S))
        chunk.save(update_fields=["state", "attempts", "claimed_at", "lease_until"])
        if job.state == JobState.QUEUED:
            job.state, job.started_at = JobState.RUNNING, now
            job.save(update_fields=["state", "started_at"])
    return chunk


def _locked(chunks: QuerySet[Chunk]) -> QuerySet[Chunk]:
    # SQLite has no row locks (it serialises writers): skip_locked is PostgreSQL's.
    if connection.features.has_select_for_update_skip_locked:
        return chunks.select_for_update(skip_locked=True)
    return chunks


def run_chunk(chunk: Chunk, client: httpx.Client | None = None) -> None:
    """Read the chunk's rows, send them, write its output file, then mark it done; a budget
    refusal pauses the job (the chunk waits for the resume), an unservable job fails."""
    job = Job.objects.select_related("version", "api_key", "tenant").get(pk=chunk.job_id)
    signature = Signature.of(job.version)
    with default_storage.open(job.input_name, "rb") as fh:
        raw_rows = read_rows(fh, job.input_format, chunk.start_row, chunk.end_row, chunk.start_byte)
    from_text = job.input_format == InputFormat.CSV
    outcomes: list[Outcome] = []
    ready: list[tuple[int, list[Any]]] = []
    for number, raw in enumerate(raw_rows, start=chunk.start_row):
        try:
            ready.append((number, convert_row(raw, signature, from_text)))
        except RowError as exc:
            outcomes.append(Outcome(number, error=str(exc)))
    if job.api_key is None:
        _end_unservable(job, "the job has no key")
        return
    url = (
        f"{str(settings.SWITCHYARD_PLATFORM_URL).rstrip('/')}/v2/models/"
        f"{job.model.name}/versions/{job.version.version}/infer"
    )
    timeout = httpx.Timeout(float(settings.SWITCHYARD_BATCH_REQUEST_TIMEOUT_S))
    with client or httpx.Client(timeout=timeout) as http:
        sender = Sender(http, url, derive_raw_key(job.api_key, key_context(job.pk)), signature)
        try:
            sent = send_all(sender, ready, lambda: _renew(chunk)) if ready else []
        except BudgetStop as exc:
            release_chunk(chunk)
            pause_job(job, SYSTEM, reason=str(exc))
            return
        except Unservable as exc:
            release_chunk(chunk)
            _end_unservable(job, str(exc))
            return
        except GaveUp:
            release_chunk(chunk)
            return
    if sent is None:  # the job was cancelled or the lease lost under it
        return
    complete_chunk(chunk, sorted([*outcomes, *sent], key=lambda o: o.row))


def _renew(chunk: Chunk) -> bool:
    """Extend the lease while the job still runs and the chunk is still this attempt's."""
    lease = timezone.now() + timedelta(seconds=float(settings.SWITCHYARD_BATCH_LEASE_S))
    return bool(
        Chunk.objects.filter(
            pk=chunk.pk,
            state=ChunkState.RUNNING,
            attempts=chunk.attempts,
            job__state__in=(JobState.RUNNING, JobState.PAUSED),
        ).update(lease_until=lease)
    )


def complete_chunk(chunk: Chunk, outcomes: list[Outcome]) -> bool:
    """Write the chunk's output file (this attempt's own name), then mark it done and count its
    rows in one transaction, only if it is still this attempt's; False if it was not."""
    name = f"{_prefix(chunk.job)}chunks/{chunk.index:06d}.{chunk.attempts}.jsonl"
    body = b"".join(orjson.dumps(o.line()) + b"\n" for o in outcomes)
    with tempfile.TemporaryFile() as tmp:
        tmp.write(body)
        tmp.seek(0)
        if default_storage.exists(name):
            default_storage.delete(name)
        name = default_storage.save(name, File(tmp))
    failed = sum(1 for o in outcomes if o.error is not None)
    with transaction.atomic():
        # Conditional update: a worker whose lease ran out (and whose chunk another worker
        # claimed again) does not mark it done; the job's counts move in the same transaction.
        marked = Chunk.objects.filter(
            pk=chunk.pk, state=ChunkState.RUNNING, attempts=chunk.attempts
        ).update(
            state=ChunkState.DONE,
            output_name=name,
            rows_ok=len(outcomes) - failed,
            rows_failed=failed,
            finished_at=timezone.now(),
        )
        if marked:
            Job.objects.filter(pk=chunk.job_id).update(
                rows_done=F("rows_done") + len(outcomes), rows_failed=F("rows_failed") + failed
            )
    if not marked:
        default_storage.delete(name)
    return bool(marked)


def release_chunk(chunk: Chunk) -> None:
    """Give a chunk back unfinished (pending again), if it is still this attempt's."""
    Chunk.objects.filter(pk=chunk.pk, state=ChunkState.RUNNING, attempts=chunk.attempts).update(
        state=ChunkState.PENDING, lease_until=None
    )


def step(job_id: int) -> bool:
    """One turn of a job's chunk loop: claim a chunk and run it; True if one ran (the task
    then queues the next turn)."""
    chunk = claim_chunk(job_id)
    if chunk is None:
        return False
    run_chunk(chunk)
    return True


def reap_stalled(now: datetime | None = None) -> int:
    """Restart the chunk loop of running jobs that have a chunk to claim (a pending one, or
    one whose worker died and lease ran out) and none at work: the loop was lost with its
    worker. Returns how many loops were queued."""
    now = now or timezone.now()
    at_work = Chunk.objects.filter(state=ChunkState.RUNNING, lease_until__gt=now)
    stalled = (
        Job.objects.filter(state__in=(JobState.QUEUED, JobState.RUNNING))
        .exclude(pk__in=at_work.values("job_id"))
        .values_list("pk", flat=True)
    )
    count = 0
    for job_id in stalled:
        send_on_commit(STEP_TASK, job_id)
        count += 1
    return count


def finish_job(job_id: int) -> Job | None:
    """Assemble the output from the done chunks' files, in order, and end the job (succeeded,
    audited ``job.finish``, its key revoked); nothing if it is not running or not complete."""
    job = Job.objects.select_related("model", "version").filter(pk=job_id).first()
    if job is None or job.state != JobState.RUNNING:
        return None
    chunks = list(job.chunks.order_by("index"))
    if any(c.state != ChunkState.DONE for c in chunks):
        return None
    name = f"{_prefix(job)}output.jsonl"
    with tempfile.TemporaryFile() as out:
        for chunk in chunks:
            with default_storage.open(chunk.output_name, "rb") as fh:
                for line in fh:
                    if "outputs" in orjson.loads(line):  # failed rows are in /errors
                        out.write(line)
        out.seek(0)
        if default_storage.exists(name):
            default_storage.delete(name)
        name = default_storage.save(name, File(out))
    with transaction.atomic():
        # Conditional update: a cancel that came while the output was assembled wins.
        ended = Job.objects.filter(pk=job.pk, state=JobState.RUNNING).update(
            state=JobState.SUCCEEDED, output_name=name, finished_at=timezone.now()
        )
        if ended:
            job.refresh_from_db()
            after = {"rows": job.rows_total, "failed": job.rows_failed, "output": name}
            audit(job.tenant_id, SYSTEM, "job.finish", _target(job), after=after)
            _revoke(job)
    return job


def _fail(job: Job, reason: str) -> None:
    """End a job as failed (inside the caller's transaction), audited, its key revoked."""
    job.state, job.error, job.finished_at = JobState.FAILED, reason[:1000], timezone.now()
    job.save(update_fields=["state", "error", "finished_at"])
    audit(
        job.tenant_id, SYSTEM, "job.finish", _target(job), after={"state": "failed"}, reason=reason
    )
    _revoke(job)


def _end_unservable(job: Job, reason: str) -> None:
    with transaction.atomic():
        locked = Job.objects.select_for_update().select_related("model", "version").get(pk=job.pk)
        if not locked.ended:
            _fail(locked, reason)


def _revoke(job: Job) -> None:
    if job.api_key_id is not None:
        revoke_api_key(job.api_key, SYSTEM)  # type: ignore[arg-type]


# Pause, resume, cancel ----------------------------------------------------------------------


def _transition(job: Job, allowed: tuple[str, ...], what: str) -> Job:
    locked = Job.objects.select_for_update().select_related("model", "version").get(pk=job.pk)
    if locked.state not in allowed:
        raise Conflict(f"the job is {locked.state}; only a {' or '.join(allowed)} job can {what}")
    return locked


def pause_job(job: Job, actor: Actor, reason: str = "") -> Job:
    """No new chunk starts (running ones finish); audited ``job.pause``."""
    with transaction.atomic():
        # Row lock: a claim in progress finishes first, and sees the pause after.
        locked = _transition(job, (JobState.QUEUED, JobState.RUNNING), "be paused")
        before = locked.state
        locked.state, locked.pause_reason = JobState.PAUSED, reason[:500]
        locked.save(update_fields=["state", "pause_reason"])
        audit(
            locked.tenant_id,
            actor,
            "job.pause",
            _target(locked),
            {"state": before},
            {"state": "paused"},
            reason=reason,
        )
    return locked


def resume_job(job: Job, actor: Actor) -> Job:
    """Run the unfinished chunks again (done ones are kept); audited ``job.resume``. Refused
    while the tenant's budget stops new work (its chunks would only be refused again)."""
    check_budget(job.tenant_id)
    with transaction.atomic():
        locked = _transition(job, (JobState.PAUSED,), "be resumed")
        locked.state = JobState.RUNNING if locked.started_at else JobState.QUEUED
        locked.pause_reason = ""
        locked.save(update_fields=["state", "pause_reason"])
        audit(
            locked.tenant_id,
            actor,
            "job.resume",
            _target(locked),
            {"state": "paused"},
            {"state": locked.state},
        )
        _start_workers(locked)
    return locked


def cancel_job(job: Job, actor: Actor) -> Job:
    """No new chunk (running ones stop at their next request round); cancelled, key revoked;
    audited ``job.cancel``."""
    with transaction.atomic():
        locked = _transition(
            job, (JobState.QUEUED, JobState.RUNNING, JobState.PAUSED), "be cancelled"
        )
        before = locked.state
        locked.state, locked.finished_at = JobState.CANCELLED, timezone.now()
        locked.save(update_fields=["state", "finished_at"])
        audit(
            locked.tenant_id,
            actor,
            "job.cancel",
            _target(locked),
            {"state": before},
            {"state": "cancelled"},
        )
        _revoke(locked)
    return locked


# Progress and results -----------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """Rows done of total, the rate over the recent chunks, the ETA and the deadline verdict
    (True: will make it or made it; False: will not or did not; None: not known yet)."""

    rows_total: int
    rows_done: int
    rows_failed: int
    percent: float
    rows_per_s: float | None
    eta_s: float | None
    on_time: bool | None


def progress(job: Job, now: datetime | None = None) -> Progress:
    return progress_of([job], now)[job.pk]


def progress_of(listed: list[Job], now: datetime | None = None) -> dict[int, Progress]:
    """Each job's progress, from one query over the jobs' last ``RECENT_CHUNKS`` done chunks."""
    now = now or timezone.now()
    recent = (
        Chunk.objects.filter(
            job_id__in=[j.pk for j in listed], state=ChunkState.DONE, finished_at__isnull=False
        )
        .annotate(
            nth=Window(RowNumber(), partition_by=[F("job_id")], order_by=F("finished_at").desc())
        )
        .filter(nth__lte=RECENT_CHUNKS)
        .values_list("job_id", "start_row", "end_row", "claimed_at", "finished_at")
    )
    timed: dict[int, list[tuple[int, datetime, datetime]]] = {}
    for job_id, start, end, began, ended in recent:
        if began and ended:
            timed.setdefault(job_id, []).append((end - start, began, ended))
    return {job.pk: _progress(job, timed.get(job.pk, []), now) for job in listed}


def _progress(job: Job, timed: list[tuple[int, datetime, datetime]], now: datetime) -> Progress:
    rate = None
    if timed:
        span = (max(t[2] for t in timed) - min(t[1] for t in timed)).total_seconds()
        rate = sum(t[0] for t in timed) / span if span > 0 else None
    left = job.rows_total - job.rows_done
    eta = None
    if job.state in (JobState.QUEUED, JobState.RUNNING) and rate:
        eta = left / rate
    elif job.state == JobState.SUCCEEDED:
        eta = 0.0
    return Progress(
        rows_total=job.rows_total,
        rows_done=job.rows_done,
        rows_failed=job.rows_failed,
        percent=round(100.0 * job.rows_done / job.rows_total, 1) if job.rows_total else 0.0,
        rows_per_s=round(rate, 2) if rate else None,
        eta_s=round(eta, 1) if eta is not None else None,
        on_time=deadline_verdict(job, eta, now),
    )


def deadline_verdict(job: Job, eta_s: float | None, now: datetime) -> bool | None:
    """Whether the job makes its deadline: by when it finished, or by now + ETA while it
    runs; None without a deadline or before a rate is known (paused: its ETA is unknown)."""
    if job.deadline is None:
        return None
    if job.state == JobState.SUCCEEDED and job.finished_at is not None:
        return job.finished_at <= job.deadline
    if job.state in ENDED:
        return False
    if now > job.deadline:
        return False
    if eta_s is None:
        return None
    return now + timedelta(seconds=eta_s) <= job.deadline


def output_file(job: Job) -> IO[bytes]:
    """The assembled output, once the job succeeded (409 before)."""
    if job.state != JobState.SUCCEEDED or not job.output_name:
        raise Conflict(f"the job is {job.state}; its output is ready once it has succeeded")
    return default_storage.open(job.output_name, "rb")


def failed_rows(job: Job, limit: int = MAX_ERRORS_SHOWN) -> list[dict[str, Any]]:
    """The failed rows so far (row number and error), in row order, at most ``limit``."""
    found: list[dict[str, Any]] = []
    chunks = job.chunks.filter(state=ChunkState.DONE, rows_failed__gt=0).order_by("index")
    for chunk in chunks:
        with default_storage.open(chunk.output_name, "rb") as fh:
            for line in fh:
                entry = orjson.loads(line)
                if "error" in entry:
                    found.append(entry)
                    if len(found) >= limit:
                        return found
    return found
