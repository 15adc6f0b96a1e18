"""DRF serializers of the audit log."""

from rest_framework import serializers

from ..models import AuditEvent


class AuditSerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditEvent
        fields = ["created_at", "actor_label", "action", "target", "before", "after", "reason"]
        read_only_fields = fields


class AuditFilter(serializers.Serializer):
    action = serializers.CharField(required=False, help_text="exact action, e.g. plan.weight")
    actor = serializers.CharField(required=False, help_text="actor label contains")
    q = serializers.CharField(required=False, help_text="target or reason contains")
    since = serializers.DateTimeField(required=False)
    limit = serializers.IntegerField(min_value=1, max_value=1000, default=200)
