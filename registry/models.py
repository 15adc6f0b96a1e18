"""Models, their immutable versions, aliases that point at versions, and each version's
reference sample for drift."""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from .signature import SignatureError, check_default_answer

name_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,99}$",
    "Use lowercase letters, digits, '.', '_' and '-', starting with a letter or digit.",
)
# The same names, for lookups (with fullmatch: "$" would let a trailing newline through).
MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")


class TaskKind(models.TextChoices):
    CLASSIFIER = "classifier"
    REGRESSOR = "regressor"
    EMBEDDING = "embedding"
    GENERATOR = "generator"


class Model(models.Model):
    """A model owned by one tenant; its name is unique within the tenant."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="models")
    name = models.CharField(max_length=100, validators=[name_validator])
    task = models.CharField(max_length=20, choices=TaskKind.choices)
    description = models.TextField(blank=True)
    # Observability: the share of predictions logged, how long logs are kept, the PSI past
    # which a feature counts as drifted, the window the drift job compares, and the SLOs.
    log_sample_rate = models.FloatField(
        default=0.1, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)]
    )
    log_retention_days = models.PositiveIntegerField(
        default=30, validators=[MinValueValidator(1), MaxValueValidator(3650)]
    )
    drift_threshold = models.FloatField(
        default=0.2, validators=[MinValueValidator(0.001), MaxValueValidator(10.0)]
    )
    drift_window_minutes = models.PositiveIntegerField(
        default=60, validators=[MinValueValidator(1), MaxValueValidator(60 * 24 * 30)]
    )
    slo_availability = models.FloatField(
        default=0.999, validators=[MinValueValidator(0.5), MaxValueValidator(0.99999)]
    )
    slo_latency_ms = models.FloatField(
        default=100.0, validators=[MinValueValidator(0.5), MaxValueValidator(60_000.0)]
    )
    slo_latency_target = models.FloatField(
        default=0.99, validators=[MinValueValidator(0.5), MaxValueValidator(0.99999)]
    )
    # The fallback ladder (see gateway.pipeline.predict): when the version asked for fails
    # (a server error, no agent, breaker open, too slow), another version of this model answers;
    # when that fails too, the default answer does, if the owner set one. Each step has its own
    # timeout (empty: what is left of the request's deadline).
    fallback_version = models.ForeignKey(
        "registry.ModelVersion",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="fallback_for",
    )
    primary_timeout_ms = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(600_000)]
    )
    fallback_timeout_ms = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(600_000)]
    )
    # OIP v2 output tensors [{"name", "datatype", "shape", "data"}], answered as is.
    default_answer = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"],
                name="model_name_unique_per_tenant",
                violation_error_message="This tenant already has a model with this name.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name}"

    def clean(self) -> None:
        if self.fallback_version_id is not None:
            fallback = self.fallback_version
            if fallback is None or fallback.model_id != self.pk:
                raise ValidationError({"fallback_version": "must be a version of this model"})
            if fallback.generates_text:
                raise ValidationError(
                    {"fallback_version": "a text-generation version cannot be a fallback"}
                )
        if self.default_answer is not None:
            try:
                check_default_answer(self.default_answer)
            except SignatureError as exc:  # the admin's form shows a ValidationError
                raise ValidationError({"default_answer": f"{exc.field}: {exc}"}) from None


class ArtifactFormat(models.TextChoices):
    ONNX = "onnx", "ONNX"
    # Safetensors weights of the known decoder-only architecture (serving_agent.textgen): no
    # pickle, so loading a tenant's upload runs no code.
    TEXTGEN = "textgen", "Text generation (safetensors)"


class Device(models.TextChoices):
    AUTO = "auto", "GPU when available, else CPU"
    CPU = "cpu", "CPU"
    CUDA = "cuda", "GPU (CUDA)"


def artifact_path(instance: ModelVersion, filename: str) -> str:
    # Content-addressed: the file name is the hash, so a stored artifact is never overwritten.
    return f"artifacts/{instance.model.tenant_id}/{instance.sha256}.{instance.format}"


class ImmutableVersionError(ValidationError):
    """Raised on any attempt to change what makes a version what it is."""


class ModelVersion(models.Model):
    """One immutable version of a model: artifact, hash, signature, lineage and metrics.

    Serving settings (batching, device preference) may change; everything in
    ``IMMUTABLE_FIELDS`` may not once the row exists.
    """

    IMMUTABLE_FIELDS = (
        "model_id",
        "version",
        "artifact",
        "sha256",
        "format",
        "inputs",
        "outputs",
        "source_commit",
        "training_data_hash",
        "parent_id",
        "offline_metrics",
        "feature_names",
    )

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    artifact = models.FileField(upload_to=artifact_path, max_length=300)
    sha256 = models.CharField(max_length=64)
    format = models.CharField(max_length=10, choices=ArtifactFormat.choices)
    # Signature: [{"name", "datatype" (OIP v2), "shape" (-1 = dynamic)}]
    inputs = models.JSONField()
    outputs = models.JSONField()
    # Optional column names for a single 2-D input, so the prediction API takes named features.
    feature_names = models.JSONField(default=list, blank=True)
    source_commit = models.CharField(max_length=64, blank=True)
    training_data_hash = models.CharField(max_length=128, blank=True)
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children"
    )
    offline_metrics = models.JSONField(default=dict, blank=True)
    # Personal data in the signature: {input or feature name: "redact" | "hash"}. Applied before
    # a prediction is logged. Mutable on purpose: marking a field later must stay possible.
    personal_fields = models.JSONField(default=dict, blank=True)
    description = models.TextField(blank=True)
    max_batch_size = models.PositiveIntegerField(
        default=32, validators=[MinValueValidator(1), MaxValueValidator(4096)]
    )
    max_queue_delay_ms = models.FloatField(
        default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(1000.0)]
    )
    max_queue = models.PositiveIntegerField(
        default=256, validators=[MinValueValidator(1), MaxValueValidator(100_000)]
    )
    device = models.CharField(max_length=10, choices=Device.choices, default=Device.AUTO)
    # Generation limits per replica (textgen versions): past them a request is refused.
    max_input_tokens = models.PositiveIntegerField(
        default=512, validators=[MinValueValidator(1), MaxValueValidator(1_000_000)]
    )
    max_output_tokens = models.PositiveIntegerField(
        default=256, validators=[MinValueValidator(1), MaxValueValidator(1_000_000)]
    )
    max_streams = models.PositiveIntegerField(
        default=16, validators=[MinValueValidator(1), MaxValueValidator(4096)]
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "-version"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "version"],
                name="version_number_unique_per_model",
                violation_error_message="This model already has a version with this number.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.model} v{self.version}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            self.check_unchanged()
        super().save(*args, **kwargs)

    def check_unchanged(self) -> None:
        stored = ModelVersion.objects.filter(pk=self.pk).values(*self.IMMUTABLE_FIELDS).first()
        if stored is None:
            return
        changed = [f for f in self.IMMUTABLE_FIELDS if stored[f] != _field_value(self, f)]
        if changed:
            raise ImmutableVersionError(
                f"Model versions are immutable; cannot change: {', '.join(changed)}."
            )

    @property
    def generates_text(self) -> bool:
        return self.format == ArtifactFormat.TEXTGEN


def _field_value(version: ModelVersion, field: str) -> object:
    value = getattr(version, field)
    return value.name if field == "artifact" else value


class Alias(models.Model):
    """A movable name (``production``, ``staging``) pointing at one version of a model."""

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="aliases")
    name = models.CharField(max_length=50, validators=[name_validator])
    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="aliases")
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "aliases"
        ordering = ["model", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "name"],
                name="alias_name_unique_per_model",
                violation_error_message="This model already has an alias with this name.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.model}@{self.name} → v{self.version.version}"

    def clean(self) -> None:
        if self.version_id and self.model_id and self.version.model_id != self.model_id:
            raise ValidationError({"version": "The version must belong to the alias's model."})


class ReferenceSample(models.Model):
    """The distribution a version's drift is measured against: a sample uploaded with the
    version, or a chosen past window of its logged predictions (copied here when chosen)."""

    version = models.OneToOneField(ModelVersion, on_delete=models.CASCADE, related_name="reference")
    source = models.CharField(max_length=10, choices=[("upload", "Upload"), ("window", "Window")])
    # {feature: [values]} and one score per row, like PredictionLog.inputs / scores.
    columns = models.JSONField()
    scores = models.JSONField(default=list, blank=True)
    rows = models.PositiveIntegerField()
    window_start = models.DateTimeField(null=True, blank=True)
    window_end = models.DateTimeField(null=True, blank=True)
    uploaded_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "rollouts_referencesample"  # created by the rollouts app, moved with its rows

    def __str__(self) -> str:
        return f"reference of v{self.version_id} ({self.source}, {self.rows} rows)"
