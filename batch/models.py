"""Batch inference jobs: an input file run through a model's agents at batch priority, split
into chunks that are claimed, run and recorded one at a time (``batch.jobs``)."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from registry.models import Model, ModelVersion
from tenants.models import ApiKey, Tenant


class JobState(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    CANCELLED = "cancelled"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# A job in one of these states never changes again (its key is revoked).
ENDED = (JobState.CANCELLED, JobState.SUCCEEDED, JobState.FAILED)


class InputFormat(models.TextChoices):
    JSONL = "jsonl"
    CSV = "csv"
    PARQUET = "parquet"


class Job(models.Model):
    """One input file run through one model version (resolved from the alias asked for at
    submission, so the whole job uses one version), its output assembled in storage."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="batch_jobs")
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="batch_jobs")
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="batch_jobs")
    asked_alias = models.CharField(max_length=64, blank=True)
    asked_version = models.PositiveIntegerField(null=True, blank=True)
    input_name = models.CharField(max_length=500)
    input_format = models.CharField(max_length=10, choices=InputFormat.choices)
    # Set once the job succeeded: the assembled output (JSONL, one line per row answered).
    output_name = models.CharField(max_length=500, blank=True)
    state = models.CharField(max_length=10, choices=JobState.choices, default=JobState.QUEUED)
    pause_reason = models.CharField(max_length=500, blank=True)
    error = models.CharField(max_length=1000, blank=True)  # why a failed job failed
    rows_total = models.PositiveIntegerField(default=0)
    rows_done = models.PositiveIntegerField(default=0)  # answered or failed: rows finished
    rows_failed = models.PositiveIntegerField(default=0)
    deadline = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    # The job's own key (predict scope, batch class), its secret derived, never stored.
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"])]

    def __str__(self) -> str:
        return f"batch job {self.pk}"

    @property
    def ended(self) -> bool:
        return self.state in ENDED


class ChunkState(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


class Chunk(models.Model):
    """Rows ``[start_row, end_row)`` of a job's input. Done only once its output file is in
    storage; a running chunk whose lease ran out is claimed again and redone from scratch."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="chunks")
    index = models.PositiveIntegerField()
    start_row = models.PositiveIntegerField()
    end_row = models.PositiveIntegerField()
    # Where row ``start_row`` begins in a text input (JSON Lines, CSV); None for Parquet.
    start_byte = models.BigIntegerField(null=True, blank=True)
    state = models.CharField(max_length=10, choices=ChunkState.choices, default=ChunkState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    claimed_at = models.DateTimeField(null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    output_name = models.CharField(max_length=500, blank=True)
    rows_ok = models.PositiveIntegerField(default=0)
    rows_failed = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["job", "index"]
        constraints = [
            models.UniqueConstraint(fields=["job", "index"], name="batch_chunk_unique_index")
        ]

    def __str__(self) -> str:
        return f"chunk {self.index} of batch job {self.job_id}"

    @property
    def rows(self) -> int:
        return self.end_row - self.start_row
