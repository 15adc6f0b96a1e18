"""Registry domain functions: version creation, serving settings and alias moves (lookups are
in ``registry.access``)."""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.base import ContentFile, File
from django.db import transaction
from django.db.models import Max, Q, QuerySet

from platform_site.errors import NotFound, TooLarge
from tenants.audit import SYSTEM, Actor, audit

from .access import version_for
from .models import Alias, ArtifactFormat, Model, ModelVersion
from .signature import (
    SignatureError,
    check_declared_matches,
    normalize_declared,
    read_onnx_signature,
    read_onnx_signature_from_file,
)

# What an upload says about a version besides its serving settings: the artifact, its signature
# and lineage. Immutable once the version exists.
UPLOAD_FIELDS = (
    "artifact",
    "format",
    "inputs",
    "outputs",
    "feature_names",
    "offline_metrics",
    "source_commit",
    "training_data_hash",
    "parent",
)
# The only fields of a version that may change after upload.
SERVING_FIELDS = (
    "max_batch_size",
    "max_queue_delay_ms",
    "max_queue",
    "device",
    "description",
    "max_input_tokens",
    "max_output_tokens",
    "max_streams",
    "personal_fields",
)
# A model's monitoring settings: prediction-log sampling and retention, drift, SLOs.
MONITORING_FIELDS = (
    "description",
    "log_sample_rate",
    "log_retention_days",
    "drift_threshold",
    "drift_window_minutes",
    "slo_availability",
    "slo_latency_ms",
    "slo_latency_target",
)
# The fallback ladder (``Model.fallback_version`` and the rest): set like the settings above.
LADDER_FIELDS = ("fallback_version", "primary_timeout_ms", "fallback_timeout_ms", "default_answer")
PERSONAL_RULES = ("redact", "hash")
# What a text-generation version takes and gives, in OIP terms (the signature is fixed by the
# architecture; streams speak the generation protocol, not tensors).
TEXTGEN_INPUTS = [{"name": "prompt", "datatype": "BYTES", "shape": [-1]}]
TEXTGEN_OUTPUTS = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


def create_version(
    model: Model,
    artifact: bytes | File,
    *,
    inputs: Any = None,
    outputs: Any = None,
    feature_names: list[str] | None = None,
    created_by: User | None = None,
    format: str = ArtifactFormat.ONNX,
    **details: Any,
) -> ModelVersion:
    """Store a new immutable version: hash the artifact, read and check its signature.

    A declared signature (``inputs``/``outputs``) must agree with the artifact's own, or the
    upload is refused; when none is declared the artifact's is recorded. A ``textgen`` artifact
    must be a safetensors file of the known architecture, checked without running any code.

    ``artifact`` may be an uploaded file: one the server spooled to disk is hashed and checked
    from disk in chunks, and moved into storage, never read into memory whole.
    """
    upload = artifact if isinstance(artifact, File) else ContentFile(artifact)
    limit = settings.SWITCHYARD_MAX_ARTIFACT_BYTES
    if not upload.size:
        raise SignatureError("artifact", "the uploaded file is empty")
    if upload.size > limit:
        raise TooLarge("artifact", f"the uploaded file is larger than the limit of {limit} bytes")
    if format == ArtifactFormat.TEXTGEN:
        real_inputs, real_outputs = _check_textgen(upload)
    else:
        real_inputs, real_outputs = _onnx_signature(upload)
    if inputs is not None:
        inputs = normalize_declared(inputs, "inputs")
        check_declared_matches(inputs, real_inputs, "inputs")
    if outputs is not None:
        outputs = normalize_declared(outputs, "outputs")
        check_declared_matches(outputs, real_outputs, "outputs")
    inputs = inputs or real_inputs
    outputs = outputs or real_outputs
    feature_names = feature_names or []
    _check_feature_names(feature_names, inputs)
    parent = details.pop("parent", None)
    if parent is not None and parent.model_id != model.pk:
        raise SignatureError("parent", "the parent version must belong to the same model")

    sha256 = _sha256(upload)
    with transaction.atomic():
        # Row lock on the model: concurrent uploads get consecutive version numbers.
        Model.objects.select_for_update().filter(pk=model.pk).first()
        latest = model.versions.aggregate(n=Max("version"))["n"] or 0
        version = ModelVersion(
            model=model,
            version=latest + 1,
            sha256=sha256,
            format=format,
            inputs=inputs,
            outputs=outputs,
            feature_names=feature_names,
            parent=parent,
            created_by=created_by,
            **details,
        )
        check_personal_fields(version, version.personal_fields)
        # A file spooled to disk is moved, not copied through memory (Django's storage).
        version.artifact.save(f"{sha256}.{format}", upload, save=False)
        version.full_clean(exclude=["artifact"])
        version.save()
    return version


def _sha256(upload: File) -> str:
    digest = hashlib.sha256()
    for chunk in upload.chunks():
        digest.update(chunk)
    return digest.hexdigest()


def _on_disk(upload: File) -> str | None:
    """The path of an upload the server spooled to disk (Django's temporary upload file)."""
    path = getattr(upload, "temporary_file_path", None)
    return path() if path is not None else None


@contextmanager
def _contents(upload: File) -> Iterator[bytes | mmap.mmap]:
    """The upload's bytes: mapped from disk (read only where looked at) when it is there."""
    path = _on_disk(upload)
    if path is None:
        upload.seek(0)
        yield upload.read()
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        yield mapped


def _onnx_signature(upload: File) -> tuple[list[dict], list[dict]]:
    """An upload on disk is checked in a child process (ONNX's checker loads the weights);
    one in memory (at most ``FILE_UPLOAD_MAX_MEMORY_SIZE``, or bytes a caller already holds)
    here."""
    path = _on_disk(upload)
    if path is not None:
        return read_onnx_signature_from_file(path)
    upload.seek(0)
    return read_onnx_signature(upload.read())


def _check_textgen(upload: File) -> tuple[list[dict], list[dict]]:
    from serving_agent.textgen import read_config  # torch: imported only for such uploads

    try:
        with _contents(upload) as data:
            read_config(data)  # reads the header, and only the size of the rest
    except ValueError as exc:
        raise SignatureError("artifact", f"not a valid text-generation artifact: {exc}") from None
    return TEXTGEN_INPUTS, TEXTGEN_OUTPUTS


def _check_feature_names(names: list[str], inputs: list[dict]) -> None:
    if not names:
        return
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise SignatureError("feature_names", "must be a list of non-empty strings")
    if len(set(names)) != len(names):
        raise SignatureError("feature_names", "must not repeat a name")
    if len(inputs) != 1 or len(inputs[0]["shape"]) != 2 or inputs[0]["shape"][1] != len(names):
        raise SignatureError(
            "feature_names",
            "needs a model with one 2-D input whose second dimension equals the number of names",
        )


def update_serving_settings(version: ModelVersion, changes: dict[str, Any]) -> ModelVersion:
    """Change batching, device or description; anything else about a version is immutable."""
    refused = sorted(set(changes) - set(SERVING_FIELDS))
    if refused:
        raise SignatureError(
            refused[0], f"model versions are immutable; cannot change {', '.join(refused)}"
        )
    if "personal_fields" in changes:
        check_personal_fields(version, changes["personal_fields"])
    for field, value in changes.items():
        setattr(version, field, value)
    version.full_clean(exclude=["artifact"])
    version.save()
    return version


def check_personal_fields(version: ModelVersion, fields: object) -> dict[str, str]:
    """``{input or feature name: "redact" | "hash"}`` naming only what the version takes."""
    if not isinstance(fields, dict):
        raise SignatureError("personal_fields", 'must be an object of name to "redact" or "hash"')
    known = {t["name"] for t in version.inputs} | set(version.feature_names)
    for name, rule in fields.items():
        if name not in known:
            raise SignatureError(
                "personal_fields", f"{name!r} is not an input or feature of this version"
            )
        if rule not in PERSONAL_RULES:
            raise SignatureError("personal_fields", f'{name!r}: use "redact" or "hash"')
    return fields


def update_model_settings(model: Model, changes: dict[str, Any]) -> Model:
    """Change a model's description, monitoring settings or fallback ladder (its name and task
    stay). ``fallback_version`` is a version number of this model, or None."""
    refused = sorted(set(changes) - set(MONITORING_FIELDS) - set(LADDER_FIELDS))
    if refused:
        raise SignatureError(refused[0], "cannot change; a model's name and task are fixed")
    if "fallback_version" in changes:
        number = changes.pop("fallback_version")
        try:
            model.fallback_version = None if number is None else version_for(model, number)
        except NotFound as exc:
            raise SignatureError("fallback_version", str(exc)) from None
    for field, value in changes.items():
        setattr(model, field, value)
    model.full_clean(exclude=["tenant"], validate_unique=False)
    model.save()
    return model


def set_alias(
    model: Model, name: str, version: ModelVersion, actor: Actor = SYSTEM, reason: str = ""
) -> Alias:
    """Point an alias at a version (creating the alias if needed), audited in the same
    transaction. Protected aliases reach here through ``rollouts.approvals``."""
    if version.model_id != model.pk:
        raise SignatureError("version", "the version must belong to this model")
    with transaction.atomic():
        # Row lock: two concurrent moves of one alias end in one consistent row.
        alias = Alias.objects.select_for_update().filter(model=model, name=name).first()
        if alias is None:
            alias = Alias(model=model, name=name)
        before = {"version": alias.version.version} if alias.version_id else {}
        alias.version = version
        alias.updated_by_id = actor.user_id
        alias.full_clean()
        alias.save()
        after = {"version": version.version}
        audit(model.tenant_id, actor, "alias.move", f"{model}@{name}", before, after, reason)
    return alias


def served_versions(tenant_id: int | None = None) -> QuerySet[ModelVersion]:
    """Versions that some alias points at, and models' fallback versions (they must be warm
    when their model fails): what agents must serve (optionally for one tenant)."""
    qs = (
        ModelVersion.objects.filter(Q(aliases__isnull=False) | Q(fallback_for__isnull=False))
        .select_related("model")
        .distinct()
    )
    if tenant_id is not None:
        qs = qs.filter(model__tenant_id=tenant_id)
    return qs.order_by("pk")
