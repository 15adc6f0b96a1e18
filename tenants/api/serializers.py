"""DRF serializers of the audit log and of API keys."""

from typing import Any

from rest_framework import serializers

from platform_site.api import MAX_INT

from ..keys import DEFAULT_ROTATION_OVERLAP_S, MAX_ROTATION_OVERLAP_S
from ..models import SCOPES, ApiKey, AuditEvent


class AuditSerializer(serializers.ModelSerializer[AuditEvent]):
    class Meta:
        model = AuditEvent
        fields = ["created_at", "actor_label", "action", "target", "before", "after", "reason"]
        read_only_fields = fields


class AuditFilter(serializers.Serializer[Any]):
    action = serializers.CharField(required=False, help_text="exact action, e.g. plan.weight")
    actor = serializers.CharField(required=False, help_text="actor label contains")
    q = serializers.CharField(required=False, help_text="target or reason contains")
    since = serializers.DateTimeField(required=False)
    limit = serializers.IntegerField(min_value=1, max_value=1000, default=200)


class ExportFilter(AuditFilter):
    # A name other than DRF's ``format`` override would be clearer, but the URL is
    # ``?format=``: the export view answers it itself (see AuditExportView).
    format = serializers.ChoiceField(choices=["csv", "jsonl"], default="csv")
    limit = serializers.IntegerField(max_value=MAX_INT, min_value=1, required=False)


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    """A key as the API lists it: never its secret or hash."""

    created_by = serializers.SerializerMethodField()
    state = serializers.CharField(read_only=True)
    display = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "display",
            "scopes",
            "created_by",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
            "state",
            "priority",
            "max_in_flight",
        ]
        read_only_fields = fields

    def get_created_by(self, key: ApiKey) -> str | None:
        return key.created_by.get_username() if key.created_by else None

    def get_display(self, key: ApiKey) -> str:
        return f"sy_{key.prefix}_…"


class ApiKeyCreateSerializer(serializers.Serializer[Any]):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=SCOPES), allow_empty=False, default=["predict"]
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True)


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(help_text="The raw key: shown in this response only.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields


class RotateSerializer(serializers.Serializer[Any]):
    overlap_s = serializers.IntegerField(
        min_value=0,
        max_value=MAX_ROTATION_OVERLAP_S,
        default=DEFAULT_ROTATION_OVERLAP_S,
        help_text="How long the old key keeps working next to the new one, in seconds.",
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True)
