"""Models, their immutable versions, aliases that point at versions, and each version's
reference sample for drift."""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from .formats import FORMATS, Format, format_choices
from .signature import SignatureError, check_default_answer

name_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,99}$",
    "Use lowercase letters, digits, '.', '_' and '-', starting with a letter or digit.",
)
# The same names, for lookups (with fullmatch: "$" would let a trailing newline through).
MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
# Alias names: a model name's characters, at most 50 of them, and never only digits. Clients
# name an alias where they could name a version number (``/v2/models/{name}/versions/{alias}``),
# so "3" must always mean version 3. Use with fullmatch.
ALIAS_NAME = re.compile(r"(?![0-9]+\Z)[a-z0-9][a-z0-9._-]{0,49}")
alias_name_validator = RegexValidator(
    r"\A(?![0-9]+\Z)[a-z0-9][a-z0-9._-]{0,49}\Z",
    "Use lowercase letters, digits, '.', '_' and '-', starting with a letter or digit, at most "
    "50 characters and not only digits (a number names a version).",
)


# The longest a model may keep its last-known-good version warm (a week): the bound of
# ``Model.rollback_warm_s``, and how far back ``served_versions`` looks.
MAX_ROLLBACK_WARM_S = 7 * 24 * 3600


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
    # How long a version an alias moved away from stays loaded (the last-known-good, warm for
    # a rollback); empty: SWITCHYARD_ROLLBACK_WARM_S. See registry.services.served_versions.
    rollback_warm_s = models.PositiveIntegerField(
        null=True, blank=True, validators=[MaxValueValidator(MAX_ROLLBACK_WARM_S)]
    )
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


# The format values as named constants, made from the table (registry.formats.FORMATS) so a
# new format is not a second list here: code asks the table; tests and the API schema's enum
# name (SPECTACULAR_SETTINGS) use these names. django-stubs types only the class form.
ArtifactFormat = models.TextChoices(  # type: ignore[call-overload]
    "ArtifactFormat", [(value.upper(), (value, label)) for value, label in format_choices()]
)


class Device(models.TextChoices):
    AUTO = "auto", "GPU when available, else CPU"
    CPU = "cpu", "CPU"
    CUDA = "cuda", "GPU (CUDA)"


def artifact_path(instance: ModelVersion, filename: str) -> str:
    # Content-addressed: the file name is the hash, so a stored artifact is never overwritten.
    extension = FORMATS[instance.format].extension
    return f"artifacts/{instance.model.tenant_id}/{instance.sha256}.{extension}"


def tokenizer_path(instance: ModelVersion, filename: str) -> str:
    return f"artifacts/{instance.model.tenant_id}/{instance.tokenizer_sha256}.tokenizer.json"


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
        "allow_missing",
        "tokenizer",
        "tokenizer_sha256",
        "artifact_uri",
        "lineage",
    )

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    artifact = models.FileField(upload_to=artifact_path, max_length=300)
    sha256 = models.CharField(max_length=64)
    # Its entry in registry.formats.FORMATS says how it is checked, served and described.
    format = models.CharField(max_length=32, choices=format_choices)
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
    # Most requests one caller (tenant, key) may have queued while another caller has work
    # on the version; 0 means half of ``max_queue``.
    max_queue_per_caller = models.PositiveIntegerField(
        default=0, validators=[MaxValueValidator(100_000)]
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
    # Tree models mark a missing value with NaN: a version that declares it takes NaN (and
    # only NaN: infinities stay refused) in its float inputs.
    allow_missing = models.BooleanField(default=False)
    # A tokenizer (tokenizers' tokenizer.json) attached to an ONNX version, so its BYTES text
    # inputs are tokenized on the agent. Immutable, verified by its hash like the artifact.
    tokenizer = models.FileField(upload_to=tokenizer_path, max_length=300, blank=True)
    tokenizer_sha256 = models.CharField(max_length=64, blank=True)
    # Registered by reference: where the artifact lives outside the platform's own storage
    # (``s3://bucket/key``, or a local path in the embedded mode); empty when uploaded.
    artifact_uri = models.CharField(max_length=1024, blank=True)
    # Where the version came from outside Switchyard, e.g. {"mlflow": {"tracking_uri",
    # "name", "version", "run_id", "metrics", "params", "signature"}}.
    lineage = models.JSONField(default=dict, blank=True)
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

    def clean(self) -> None:
        # A per-caller cap above the whole queue would never bite: refuse it rather than
        # let a flooding caller believe it is capped.
        if self.max_queue_per_caller > self.max_queue:
            raise ValidationError(
                {
                    "max_queue_per_caller": f"must be at most max_queue ({self.max_queue}); "
                    "0 means half of max_queue"
                }
            )

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
    def format_entry(self) -> Format:
        return FORMATS[self.format]

    @property
    def generates_text(self) -> bool:
        return self.format_entry.generates_text


def _field_value(version: ModelVersion, field: str) -> object:
    value = getattr(version, field)
    return value.name if field in ("artifact", "tokenizer") else value


class Alias(models.Model):
    """A movable name (``production``, ``staging``) pointing at one version of a model."""

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="aliases")
    name = models.CharField(max_length=50, validators=[alias_name_validator])
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


class AliasChange(models.Model):
    """One move of an alias, written by ``registry.services.set_alias`` in the move's own
    transaction: the alias's history, and where a rollback may go (a version it pointed at
    before). A break-glass rollback (``rollouts.rollback``) is flagged until an approver other
    than the person who took it marks it reviewed."""

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="alias_changes")
    alias = models.CharField(max_length=50)
    from_version = models.ForeignKey(
        ModelVersion, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    to_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_label = models.CharField(max_length=200)
    reason = models.TextField(blank=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    break_glass = models.BooleanField(default=False)
    reviewed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reviewed_by_label = models.CharField(max_length=200, blank=True)
    reviewed_at = models.DateTimeField(null=True, blank=True)
    review_comment = models.TextField(blank=True)

    class Meta:
        ordering = ["-at", "-pk"]
        indexes = [models.Index(fields=["model", "alias", "-at"], name="alias_change_history")]

    def __str__(self) -> str:
        was = f"v{self.from_version.version}" if self.from_version else "nothing"
        return f"{self.model}@{self.alias}: {was} → v{self.to_version.version}"

    @property
    def needs_review(self) -> bool:
        return self.break_glass and self.reviewed_at is None


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
