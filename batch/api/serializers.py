"""The batch jobs API's bodies and answers."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from ..jobs import Progress, progress
from ..models import InputFormat, Job


class JobSubmitSerializer(serializers.Serializer[Any]):
    """A job: a multipart ``file``, or ``input`` (a name in the platform's storage)."""

    model = serializers.CharField(max_length=100)
    alias = serializers.CharField(max_length=64, required=False)
    version = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False)
    format = serializers.ChoiceField(choices=InputFormat.choices)
    file = serializers.FileField(required=False, allow_empty_file=True)
    input = serializers.CharField(max_length=400, required=False)
    deadline = serializers.DateTimeField(required=False)


class JobSerializer(serializers.ModelSerializer[Job]):
    model = serializers.CharField(source="model.name")
    version = serializers.IntegerField(source="version.version")
    alias = serializers.CharField(source="asked_alias")
    format = serializers.CharField(source="input_format")
    progress = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id",
            "model",
            "version",
            "alias",
            "format",
            "state",
            "pause_reason",
            "error",
            "rows_total",
            "rows_done",
            "rows_failed",
            "deadline",
            "progress",
            "created_at",
            "started_at",
            "finished_at",
        ]

    def get_progress(self, job: Job) -> dict[str, Any]:
        # A list passes every job's progress, read in one query (``jobs.progress_of``).
        known: dict[int, Progress] = self.context.get("progress", {})
        p = known.get(job.pk) or progress(job)
        return {
            "percent": p.percent,
            "rows_per_s": p.rows_per_s,
            "eta_s": p.eta_s,
            "on_time": p.on_time,
        }
