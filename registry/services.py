"""Registry domain functions: version creation, serving settings and alias moves (lookups are
in ``registry.access``)."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.base import ContentFile, File
from django.db import IntegrityError, transaction
from django.db.models import Max, Q, QuerySet
from django.db.models.fields.files import FieldFile
from django.utils import timezone

from platform_site.errors import Forbidden, NotFound, TooLarge, Unavailable
from serving_agent.pickles import pickle_kind
from tenants.audit import SYSTEM, Actor, audit

from .access import version_for
from .formats import DEFAULT_FORMAT, format_of, labels_where
from .formats import TEXTGEN_INPUTS as TEXTGEN_INPUTS  # re-exported: tests and tools import it
from .formats import TEXTGEN_OUTPUTS as TEXTGEN_OUTPUTS
from .graphs import node_target
from .models import MAX_ROLLBACK_WARM_S, Alias, AliasChange, Model, ModelVersion
from .signature import (
    SignatureError,
    check_declared_matches,
    normalize_declared,
    with_artifact_parameters,
)
from .text import check_tokenizer, text_signature

# What an upload says about a version besides its serving settings: the artifact, its signature
# and lineage. Immutable once the version exists.
UPLOAD_FIELDS = (
    "artifact",
    "tokenizer",
    "format",
    "inputs",
    "outputs",
    "feature_names",
    "offline_metrics",
    "source_commit",
    "training_data_hash",
    "parent",
    # Float inputs take NaN as a missing value (tree models); fixed with the artifact.
    "allow_missing",
)
# The only fields of a version that may change after upload.
SERVING_FIELDS = (
    "max_batch_size",
    "max_queue_delay_ms",
    "max_queue",
    # Most requests one caller may hold queued while another has work (0: half of max_queue).
    "max_queue_per_caller",
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
    # How long the last-known-good version stays warm after its alias moves (null: the
    # SWITCHYARD_ROLLBACK_WARM_S default); see served_versions.
    "rollback_warm_s",
)
# The fallback ladder (``Model.fallback_version`` and the rest): set like the settings above.
LADDER_FIELDS = ("fallback_version", "primary_timeout_ms", "fallback_timeout_ms", "default_answer")
PERSONAL_RULES = ("redact", "hash")


def store_errors() -> tuple[type[BaseException], ...]:
    """What a storage backend raises when it cannot take or give a file: the disk's OSError,
    and botocore's errors with S3 (an unreachable endpoint, a missing bucket, a denied write)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # the embedded install may have no S3 libraries
        return (OSError,)
    return (OSError, BotoCoreError, ClientError)


def create_version(
    model: Model,
    artifact: bytes | File[bytes],
    *,
    inputs: Any = None,
    outputs: Any = None,
    feature_names: list[str] | None = None,
    created_by: User | None = None,
    format: str = DEFAULT_FORMAT,
    actor: Actor = SYSTEM,
    tokenizer: bytes | File[bytes] | None = None,
    stored_name: str | None = None,
    **details: Any,
) -> ModelVersion:
    """Store a new immutable version: hash the artifact, read and check its signature.

    A declared signature (``inputs``/``outputs``) must agree with the artifact's own, or the
    upload is refused; when none is declared the artifact's is recorded. The artifact is
    checked, without running any code, by its format's entry in ``registry.formats``, which
    also reads its signature. Pickle data is refused in every format, before that check.

    ``artifact`` may be an uploaded file: one the server spooled to disk is hashed and checked
    from disk in chunks, and moved into storage, never read into memory whole.

    A ``tokenizer`` (tokenizer.json) on an ONNX version makes it take text (``registry.text``).

    ``stored_name``: the artifact already lies in storage under this name (registration by
    reference, ``registry.artifact_refs``); ``artifact`` is then a local copy to check, and
    nothing is written to storage.
    """
    upload = artifact if isinstance(artifact, File) else ContentFile(artifact)
    limit = settings.SWITCHYARD_MAX_ARTIFACT_BYTES
    if not upload.size:
        raise SignatureError("artifact", "the uploaded file is empty")
    if upload.size > limit:
        raise TooLarge("artifact", f"the uploaded file is larger than the limit of {limit} bytes")
    refuse_pickle(upload, "artifact")
    if tokenizer is not None:
        refuse_pickle(
            tokenizer if isinstance(tokenizer, File) else ContentFile(tokenizer), "tokenizer"
        )
    fmt = format_of(format)
    real_inputs, real_outputs = fmt.check(upload)
    if fmt.compose is not None:
        # Composed of this tenant's own versions: checked against them as the tenant sees them
        # (another tenant's model is "not found"), and its signature is derived from theirs.
        (real_inputs, real_outputs), kept = fmt.compose(
            upload, partial(node_target, model.tenant_id)
        )
        details["lineage"] = {**(details.get("lineage") or {}), **kept}
    tokenizer_file = None
    if tokenizer is not None:
        if not fmt.takes_tokenizer:
            takers = labels_where(lambda f: f.takes_tokenizer)
            raise SignatureError("tokenizer", f"a tokenizer attaches to {takers} versions only")
        tokenizer_file = tokenizer if isinstance(tokenizer, File) else ContentFile(tokenizer)
        check_tokenizer(tokenizer_file)
        real_inputs, real_outputs = text_signature(real_inputs, real_outputs)
    if inputs is not None:
        inputs = normalize_declared(inputs, "inputs")
        check_declared_matches(inputs, real_inputs, "inputs")
    if outputs is not None:
        outputs = normalize_declared(outputs, "outputs")
        check_declared_matches(outputs, real_outputs, "outputs")
        outputs = with_artifact_parameters(outputs, real_outputs)
    inputs = inputs or real_inputs
    outputs = outputs or real_outputs
    if not feature_names and fmt.features is not None:
        feature_names = fmt.features(upload)
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
        try:
            if stored_name is not None:
                version.artifact.name = stored_name
            else:
                store_once(version.artifact, upload)
            if tokenizer_file is not None:
                version.tokenizer_sha256 = _sha256(tokenizer_file)
                store_once(version.tokenizer, tokenizer_file)
        except store_errors() as exc:
            raise Unavailable(f"the artifact store did not take the file: {exc}") from None
        version.full_clean(exclude=["artifact"])
        version.save()
        after = {
            "sha256": sha256,
            "format": format,
            "size": upload.size,
            "artifact_uri": version.artifact_uri,
            "tokenizer_sha256": version.tokenizer_sha256,
            "parent": parent.version if parent is not None else None,
            **{
                f: getattr(version, f)
                for f in ("source_commit", "training_data_hash", "allow_missing")
            },
            **{f: getattr(version, f) for f in SERVING_FIELDS},
        }
        audit(model.tenant_id, actor, "version.create", str(version), after=after)
    return version


def store_once(field: FieldFile, upload: File[bytes]) -> None:
    """Store ``upload`` as the file of ``field`` (a version's artifact or tokenizer), unless the
    tenant already stored the same bytes: then the version names that file.

    Stored names are content hashes inside the tenant's own folder (``registry.models``), so a
    file of that name and size holds these bytes (and agents check the sha256 of every
    download). Only the tenant's own folder is looked in: another tenant's identical upload is
    stored again, so nothing observable tells one tenant what another uploaded. Stored files
    are never deleted with a version, so a file shared by several versions stays while any
    refers to it.
    """
    name = field.field.generate_filename(field.instance, "")
    if field.storage.exists(name) and field.storage.size(name) == upload.size:
        field.name = name
        return
    # A file spooled to disk is moved, not copied through memory (Django's storage); S3 gets
    # it in multipart chunks read from disk. A name taken meanwhile (a concurrent identical
    # upload, or a partial file) gets a suffix from the storage rather than an overwrite.
    field.save(name, upload, save=False)


def _sha256(upload: File[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in upload.chunks():
        digest.update(chunk)
    return digest.hexdigest()


def refuse_pickle(upload: File[bytes], field: str) -> None:
    """Refuse pickle data whatever format the upload claims: unpickling runs the writer's code."""
    kind = pickle_kind(upload)
    if kind is not None:
        raise SignatureError(
            field,
            f"pickle files are refused: the {field} is {kind}, and loading a pickle runs "
            "whatever code its writer chose. Upload ONNX, a torch.export archive "
            "(torch.export.save) or safetensors weights instead.",
        )


def _check_feature_names(names: list[str], inputs: list[dict[str, Any]]) -> None:
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


def update_serving_settings(
    version: ModelVersion, changes: dict[str, Any], actor: Actor = SYSTEM
) -> ModelVersion:
    """Change batching, device, description or the personal-field rules, audited (only what
    changed); anything else about a version is immutable."""
    refused = sorted(set(changes) - set(SERVING_FIELDS))
    if refused:
        raise SignatureError(
            refused[0], f"model versions are immutable; cannot change {', '.join(refused)}"
        )
    if "personal_fields" in changes:
        check_personal_fields(version, changes["personal_fields"])
    before = {f: getattr(version, f) for f in changes if getattr(version, f) != changes[f]}
    for field, value in changes.items():
        setattr(version, field, value)
    version.full_clean(exclude=["artifact"])
    with transaction.atomic():
        version.save()
        if before:
            after = {f: getattr(version, f) for f in before}
            audit(version.model.tenant_id, actor, "version.settings", str(version), before, after)
    return version


def check_personal_fields(version: ModelVersion, fields: object) -> dict[str, str]:
    """``{input or feature name: "redact" | "hash"}`` naming only what the version takes; a
    text generator's may also name its output, ``text`` (the completion its log keeps)."""
    if not isinstance(fields, dict):
        raise SignatureError("personal_fields", 'must be an object of name to "redact" or "hash"')
    known = {t["name"] for t in version.inputs} | set(version.feature_names)
    if version.format_entry.generates_text:
        known |= {t["name"] for t in version.outputs}
    for name, rule in fields.items():
        if name not in known:
            what = "an input, output" if version.format_entry.generates_text else "an input"
            raise SignatureError(
                "personal_fields", f"{name!r} is not {what} or feature of this version"
            )
        if rule not in PERSONAL_RULES:
            raise SignatureError("personal_fields", f'{name!r}: use "redact" or "hash"')
    return fields


def update_model_settings(
    model: Model, changes: dict[str, Any], actor: Actor = SYSTEM, *, judged: bool = False
) -> Model:
    """Change a model's description, monitoring settings or fallback ladder (its name and task
    stay), audited. ``fallback_version`` is a version number of this model, or None.

    The fallback ladder decides which version answers when the primary fails, so it changes
    only through the traffic gate (``rollouts.gate.update_model_settings``, which passes
    ``judged``): a caller that skips the gate is refused, not trusted."""
    refused = sorted(set(changes) - set(MONITORING_FIELDS) - set(LADDER_FIELDS))
    if refused:
        raise SignatureError(refused[0], "cannot change; a model's name and task are fixed")
    if not judged and set(changes) & set(LADDER_FIELDS):
        raise Forbidden("the fallback ladder changes only through the traffic gate (rollouts.gate)")
    changes = dict(changes)  # the caller's dict stays as it was
    before = {f: model_setting(model, f) for f in changes}
    if "fallback_version" in changes:
        number = changes.pop("fallback_version")
        try:
            model.fallback_version = None if number is None else version_for(model, number)
        except NotFound as exc:
            raise SignatureError("fallback_version", str(exc)) from None
    for field, value in changes.items():
        setattr(model, field, value)
    model.full_clean(exclude=["tenant"], validate_unique=False)
    with transaction.atomic():
        model.save()
        after = {f: model_setting(model, f) for f in before}
        audit(model.tenant_id, actor, "model.update", model.name, before, after)
    return model


class DuplicateName(SignatureError):
    """A model name the tenant already uses."""


def create_model(tenant_id: int, actor: Actor, name: str, task: str, **settings: Any) -> Model:
    """Register a model in a tenant, audited in the same transaction. ``settings`` are the
    model's monitoring settings (``MONITORING_FIELDS``), validated like an update's."""
    model = Model(tenant_id=tenant_id, name=name, task=task, **settings)
    model.full_clean(exclude=["tenant"], validate_unique=False)
    try:
        with transaction.atomic():
            # The unique (tenant, name) constraint decides a race between two creators.
            model.save()
            after = {"task": task, **{f: getattr(model, f) for f in settings}}
            audit(tenant_id, actor, "model.create", name, {}, after)
    except IntegrityError:
        raise DuplicateName("name", "this tenant already has a model with this name") from None
    return model


def model_setting(model: Model, field: str) -> object:
    """A model setting as the audit log records it (the fallback by its version number)."""
    if field == "fallback_version":
        return model.fallback_version.version if model.fallback_version else None
    return getattr(model, field)


def set_alias(
    model: Model,
    name: str,
    version: ModelVersion,
    actor: Actor = SYSTEM,
    reason: str = "",
    *,
    break_glass: bool = False,
) -> Alias:
    """Point an alias at a version (creating the alias if needed), audited and recorded in the
    alias's history (``AliasChange``) in the same transaction. Protected aliases reach here
    through ``rollouts.approvals``; a break-glass rollback through ``rollouts.rollback``."""
    if version.model_id != model.pk:
        raise SignatureError("version", "the version must belong to this model")
    with transaction.atomic():
        # Row lock: two concurrent moves of one alias end in one consistent row.
        alias = Alias.objects.select_for_update().filter(model=model, name=name).first()
        if alias is None:
            alias = Alias(model=model, name=name)
        before = {"version": alias.version.version} if alias.version_id else {}
        from_version_id = alias.version_id
        alias.version = version
        alias.updated_by_id = actor.user_id
        alias.full_clean()
        alias.save()
        after = {"version": version.version}
        AliasChange.objects.create(
            model=model,
            alias=name,
            from_version_id=from_version_id,
            to_version=version,
            actor_id=actor.user_id,
            actor_label=actor.label,
            reason=reason,
            break_glass=break_glass,
        )
        action = "alias.rollback" if break_glass else "alias.move"
        if break_glass:
            after["break_glass"] = True
        audit(model.tenant_id, actor, action, f"{model}@{name}", before, after, reason)
    return alias


def alias_history(model: Model, alias: str) -> QuerySet[AliasChange]:
    """An alias's moves, newest first."""
    return AliasChange.objects.filter(model=model, alias=alias).select_related(
        "from_version", "to_version"
    )


def warm_window_s(model: Model) -> int:
    """How long this model's last-known-good version stays loaded after its alias moves."""
    if model.rollback_warm_s is not None:
        return model.rollback_warm_s
    return int(settings.SWITCHYARD_ROLLBACK_WARM_S)


def last_known_good_ids(tenant_id: int | None = None) -> set[int]:
    """Versions an alias moved away from within their model's warm window (see
    ``warm_window_s``): kept loaded so that a rollback to them needs no cold load."""
    now = timezone.now()
    oldest = now - timedelta(seconds=max(MAX_ROLLBACK_WARM_S, settings.SWITCHYARD_ROLLBACK_WARM_S))
    changes = AliasChange.objects.filter(from_version__isnull=False, at__gte=oldest)
    if tenant_id is not None:
        changes = changes.filter(model__tenant_id=tenant_id)
    default = int(settings.SWITCHYARD_ROLLBACK_WARM_S)
    ids: set[int] = set()
    for version_id, at, own in changes.values_list(
        "from_version_id", "at", "model__rollback_warm_s"
    ):
        window = default if own is None else own
        if at >= now - timedelta(seconds=window):
            ids.add(version_id)
    return ids


def served_versions(tenant_id: int | None = None) -> QuerySet[ModelVersion]:
    """Versions that some alias points at, models' fallback versions (they must be warm
    when their model fails) and last-known-good versions (``last_known_good_ids``): what
    agents must serve (optionally for one tenant)."""
    qs = (
        ModelVersion.objects.filter(
            Q(aliases__isnull=False)
            | Q(fallback_for__isnull=False)
            | Q(pk__in=last_known_good_ids(tenant_id))
        )
        .select_related("model")
        .distinct()
    )
    if tenant_id is not None:
        qs = qs.filter(model__tenant_id=tenant_id)
    return qs.order_by("pk")
