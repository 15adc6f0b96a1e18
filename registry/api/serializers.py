"""DRF serializers for models, versions, aliases and reference samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from platform_site.api import MAX_INT, JSONTextField

from ..formats import DEFAULT_FORMAT, format_choices
from ..models import Alias, AliasChange, Model, ModelVersion
from ..reference import normalize_reference, rows_from_csv
from ..services import LADDER_FIELDS, MONITORING_FIELDS, SERVING_FIELDS, UPLOAD_FIELDS


class ModelSerializer(serializers.ModelSerializer[Model]):
    aliases = serializers.SerializerMethodField()
    fallback_version = serializers.IntegerField(
        source="fallback_version.version", read_only=True, default=None, allow_null=True
    )

    class Meta:
        model = Model
        fields = ["name", "task", *MONITORING_FIELDS, *LADDER_FIELDS, "created_at", "aliases"]
        read_only_fields = [
            "created_at",
            "aliases",
            "primary_timeout_ms",
            "fallback_timeout_ms",
            "default_answer",
        ]
        # Uniqueness per tenant is checked in the view, which knows the tenant.
        validators: list[Callable[..., None]] = []

    def get_aliases(self, obj: Model) -> dict[str, int]:
        return {a.name: a.version.version for a in obj.aliases.select_related("version")}


class VersionSerializer(serializers.ModelSerializer[ModelVersion]):
    model = serializers.CharField(source="model.name", read_only=True)
    # DRF moves declared fields off the class; the stubs see them shadow Field.parent.
    parent = serializers.IntegerField(  # type: ignore[assignment]
        source="parent.version", read_only=True, default=None
    )
    aliases: serializers.SlugRelatedField[Alias] = serializers.SlugRelatedField(
        many=True, read_only=True, slug_field="name"
    )

    class Meta:
        model = ModelVersion
        fields = [
            "model",
            "version",
            "sha256",
            "artifact_uri",
            "format",
            "inputs",
            "outputs",
            "feature_names",
            "allow_missing",
            "source_commit",
            "training_data_hash",
            "parent",
            "lineage",
            "tokenizer_sha256",
            "offline_metrics",
            "personal_fields",
            "description",
            "max_batch_size",
            "max_queue_delay_ms",
            "max_queue",
            "max_queue_per_caller",
            "device",
            "max_input_tokens",
            "max_output_tokens",
            "max_streams",
            "aliases",
            "created_at",
        ]
        read_only_fields = fields


class ReferenceUploadSerializer(serializers.Serializer[Any]):
    """A reference sample as rows or as columns, with an optional score per row."""

    rows = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text='[{"age": 41, "plan": "pro"}, ...]',
    )
    columns = serializers.DictField(
        child=serializers.ListField(),
        required=False,
        help_text='{"age": [41, 35, ...], "plan": ["pro", "free", ...]}',
    )
    scores = serializers.ListField(
        child=serializers.FloatField(allow_null=True),
        required=False,
        help_text="the model's score per row (positive-class probability or regressor value)",
    )

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if ("rows" in data) == ("columns" in data):
            raise serializers.ValidationError("send exactly one of 'rows' or 'columns'")
        return data


@extend_schema_field({"type": "string", "format": "binary"})
class ReferenceField(serializers.Field[Any, Any, Any, Any]):
    """A drift reference sent with the version: a JSON file or field (``{"rows": [...]}`` or
    ``{"columns": {...}}``, optional ``"scores"``), or a ``.csv`` file with a header row (a
    ``_score`` column holds the scores). Checked here, so a bad one refuses the whole upload."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        text = data
        if hasattr(data, "read"):  # an uploaded file
            try:
                text = data.read().decode("utf-8-sig")
            except UnicodeDecodeError:
                raise serializers.ValidationError("must be UTF-8 text: JSON or CSV") from None
        try:
            if hasattr(data, "read") and data.name.lower().endswith(".csv"):
                rows, scores = rows_from_csv(text)
                body = {"rows": rows} | ({"scores": scores} if scores else {})
            else:
                body = orjson.loads(text)  # not the stdlib: nesting past a limit is an error
        except ValueError:  # orjson.JSONDecodeError is one
            raise serializers.ValidationError(
                'must be JSON ({"rows": [...]} or {"columns": {...}}) or a CSV file'
            ) from None
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.messages) from None
        reference = ReferenceUploadSerializer(data=body)
        if not reference.is_valid():
            raise serializers.ValidationError(reference.errors)
        try:
            normalize_reference(**reference.validated_data)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None
        return dict(reference.validated_data)

    def to_representation(self, value: dict[str, Any]) -> dict[str, Any]:
        return value


PERSONAL_FIELDS_HELP = 'personal data in the signature: {input or feature name: "redact" | "hash"}'


class ServingSettingsSerializer(serializers.ModelSerializer[ModelVersion]):
    """A version's serving settings, the only fields of a version that may change
    (``registry.services.SERVING_FIELDS``); their bounds are the model's."""

    class Meta:
        model = ModelVersion
        fields = list(SERVING_FIELDS)
        extra_kwargs = {"personal_fields": {"help_text": PERSONAL_FIELDS_HELP}}


class VersionUploadSerializer(ServingSettingsSerializer):
    """A multipart upload: the artifact, its signature and lineage, and the serving settings.
    JSON-valued fields arrive as JSON strings."""

    artifact = serializers.FileField(required=False)
    artifact_uri = serializers.CharField(
        max_length=1024,
        required=False,
        help_text="register by reference instead of uploading: s3://<bucket>/<key> in the "
        "platform's bucket under the tenant's import prefix, or a path under an allowed local "
        "import directory (docs/storage.md)",
    )
    tokenizer = serializers.FileField(
        required=False,
        help_text="a tokenizer.json (Hugging Face tokenizers) for an ONNX model taking "
        "input_ids/attention_mask/token_type_ids: the version then takes a BYTES text input",
    )
    format = serializers.ChoiceField(choices=format_choices(), default=DEFAULT_FORMAT)
    inputs = JSONTextField(required=False)
    outputs = JSONTextField(required=False)
    feature_names = JSONTextField(required=False)
    offline_metrics = JSONTextField(required=False)
    source_commit = serializers.CharField(max_length=64, required=False, allow_blank=True)
    training_data_hash = serializers.CharField(max_length=128, required=False, allow_blank=True)
    # DRF moves declared fields off the class; the stubs see them shadow Field.parent.
    parent = serializers.IntegerField(max_value=MAX_INT, min_value=1, required=False)  # type: ignore[assignment]
    personal_fields = JSONTextField(required=False, help_text=PERSONAL_FIELDS_HELP)
    reference = ReferenceField(
        required=False, help_text="a drift reference sample: JSON rows or columns, or CSV"
    )

    class Meta(ServingSettingsSerializer.Meta):
        fields = [*UPLOAD_FIELDS, "artifact_uri", *SERVING_FIELDS, "reference"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("artifact" in attrs) == ("artifact_uri" in attrs):
            raise serializers.ValidationError(
                {"artifact": "send exactly one of 'artifact' (a file) or 'artifact_uri'"}
            )
        return attrs

    def validate_offline_metrics(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be a JSON object of metric name to value")
        return value


class AliasSerializer(serializers.Serializer[Any]):
    name = serializers.CharField(read_only=True)
    version = serializers.IntegerField(max_value=MAX_INT, min_value=1)
    comment = serializers.CharField(
        write_only=True, required=False, allow_blank=True, default="", help_text="why (audited)"
    )
    updated_at = serializers.DateTimeField(read_only=True)

    def to_representation(self, alias: Alias) -> dict[str, Any]:
        return {
            "name": alias.name,
            "version": alias.version.version,
            "updated_at": alias.updated_at,
        }


class ModelUpdateSerializer(serializers.ModelSerializer[Model]):
    """A model's description, monitoring settings and fallback ladder; its name and task are
    fixed. ``fallback_version`` is a version number of this model (null: none)."""

    fallback_version = serializers.IntegerField(
        max_value=MAX_INT, min_value=1, allow_null=True, required=False
    )

    class Meta:
        model = Model
        fields = [*MONITORING_FIELDS, *LADDER_FIELDS]


class AliasChangeSerializer(serializers.ModelSerializer[AliasChange]):
    """One move of an alias: its history as ``GET .../aliases/{alias}/history`` lists it."""

    from_version = serializers.IntegerField(
        source="from_version.version", read_only=True, allow_null=True, default=None
    )
    to_version = serializers.IntegerField(source="to_version.version", read_only=True)
    actor = serializers.CharField(source="actor_label", read_only=True)
    reviewed_by = serializers.CharField(source="reviewed_by_label", read_only=True)
    needs_review = serializers.BooleanField(read_only=True)

    class Meta:
        model = AliasChange
        fields = [
            "id",
            "alias",
            "from_version",
            "to_version",
            "actor",
            "reason",
            "at",
            "break_glass",
            "needs_review",
            "reviewed_by",
            "reviewed_at",
            "review_comment",
        ]
        read_only_fields = fields
