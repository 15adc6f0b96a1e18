"""The generation log over the API: a text generator's logged generations (a sample), paged or
exported whole for a time range; every lookup goes through the caller's tenant."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import MAX_INT
from registry.access import model_for
from registry.models import Model, TaskKind
from tenants.authentication import CallerRequest, TenantRolePermission

from ..generation_log import (
    EXPORT_FORMATS,
    GenerationFilter,
    export_generations,
    generation_summary,
    logged_generations,
)

DEFAULT_WINDOW = timedelta(hours=24)
MAX_WINDOW = timedelta(days=3650)
CONTENT_TYPES = {
    "jsonl": "application/x-ndjson",
    "csv": "text/csv",
    "parquet": "application/vnd.apache.parquet",
}


def _generator(request: CallerRequest, name: str) -> Model:
    model = model_for(request.caller.tenant_id, name)
    if model.task != TaskKind.GENERATOR:
        raise NotFound(f"model {name!r} does not generate text: it logs predictions")
    return model


class GenerationQuery(serializers.Serializer[Any]):
    since = serializers.DateTimeField(required=False, help_text="default: 24 hours ago")
    until = serializers.DateTimeField(required=False)
    version = serializers.IntegerField(required=False, min_value=1, max_value=MAX_INT)
    finish_reason = serializers.CharField(required=False, max_length=32)
    request_id = serializers.CharField(required=False, max_length=128)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=500, default=50)
    offset = serializers.IntegerField(required=False, min_value=0, max_value=MAX_INT, default=0)
    # Not "format": DRF reads that one to pick a renderer.
    export = serializers.ChoiceField(
        choices=EXPORT_FORMATS,
        required=False,
        help_text="export every match (no paging) as JSON lines, CSV or Parquet",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        now = timezone.now()
        since = attrs.get("since") or now - DEFAULT_WINDOW
        until = attrs.get("until")
        if until is not None and until <= since:
            raise ValidationError({"until": "must be after since"})
        if (until or now) - since > MAX_WINDOW:
            raise ValidationError({"since": "the window is at most ten years"})
        attrs["since"] = since
        return attrs


def _where(attrs: dict[str, Any]) -> GenerationFilter:
    return GenerationFilter(
        since=attrs["since"],
        until=attrs.get("until"),
        version=attrs.get("version"),
        finish_reason=attrs.get("finish_reason"),
        request_id=attrs.get("request_id"),
    )


class GenerationSerializer(serializers.Serializer[Any]):
    request_id = serializers.CharField()
    trace_id = serializers.CharField()
    version = serializers.IntegerField()
    version_id = serializers.IntegerField()
    arm = serializers.CharField()
    door = serializers.CharField()
    created_at = serializers.DateTimeField()
    prompt = serializers.CharField(help_text='"[redacted]" or a keyed hash where the version says')
    completion = serializers.CharField()
    truncated = serializers.BooleanField()
    params = serializers.DictField()
    input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    finish_reason = serializers.CharField()
    status = serializers.IntegerField()
    ttft_ms = serializers.FloatField(allow_null=True)
    total_ms = serializers.FloatField()
    tokens_per_second = serializers.FloatField(allow_null=True)
    # DRF moves declared fields off the class; the stubs see them shadow Field.label.
    label = serializers.JSONField(allow_null=True)  # type: ignore[assignment]


class GenerationPageSerializer(serializers.Serializer[Any]):
    count = serializers.IntegerField()
    summary = serializers.ListField(child=serializers.DictField())
    results = GenerationSerializer(many=True)


class GenerationListView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[GenerationQuery], responses=GenerationPageSerializer)
    def get(self, request: CallerRequest, name: str) -> Response | HttpResponse:
        model = _generator(request, name)
        query = GenerationQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        attrs = query.validated_data
        where = _where(attrs)
        fmt = attrs.get("export")
        if fmt is not None:
            response = HttpResponse(
                export_generations(model, where, fmt), content_type=CONTENT_TYPES[fmt]
            )
            response["Content-Disposition"] = f'attachment; filename="{model.name}.{fmt}"'
            return response
        rows, total = logged_generations(model, where, attrs["limit"], attrs["offset"])
        return Response(
            {
                "count": total,
                "summary": generation_summary(model, where),
                "results": GenerationSerializer(rows, many=True).data,
            }
        )
