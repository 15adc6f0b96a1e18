"""Ground-truth feedback, the prediction log and online quality over the API; every lookup
goes through the caller's tenant."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.http import FileResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import MAX_INT, ExportFormatParam
from platform_site.parsers import JSONBodyParser
from registry.access import model_for
from registry.models import Model
from tenants.authentication import CallerRequest, TenantRolePermission

from .. import quality

DEFAULT_SINCE = {"hour": timedelta(hours=24), "day": timedelta(days=30)}


def _model(request: CallerRequest, name: str) -> Model:
    return model_for(request.caller.tenant_id, name)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float)  # bool is an int: True is class 1


class LabelField(serializers.JSONField):
    """A number (or boolean) for a one-row request, or a list of them, one per row."""

    # drf-stubs expect a JSONField to hold an object or a list of them; a label is a number.
    def to_internal_value(self, data: Any) -> float | list[float | None]:  # type: ignore[override]
        if _is_number(data):
            return data
        if isinstance(data, list) and data and all(_is_number(v) or v is None for v in data):
            return data
        raise ValidationError(
            "must be a number (a class index or a value) or a non-empty list of numbers, one "
            "per row of the request (null for a row without a label)"
        )


class FeedbackItemSerializer(serializers.Serializer[Any]):
    request_id = serializers.CharField(max_length=128)
    # DRF moves declared fields off the class; the stubs see them shadow Field.label.
    label = LabelField()  # type: ignore[assignment]


class FeedbackBulkSerializer(serializers.Serializer[Any]):
    items = serializers.ListField(min_length=1, max_length=quality.MAX_FEEDBACK_ITEMS)


class FeedbackResultSerializer(serializers.Serializer[Any]):
    accepted = serializers.IntegerField(help_text="labels stored (a repeated request id once)")
    matched = serializers.IntegerField(
        help_text="of those, request ids in the last 24 hours of the log (older ones still join)"
    )


def feedback_items(data: object) -> list[dict[str, Any]]:
    """The labels of a single (``request_id`` and ``label``) or bulk (``items``) body; a bad
    item is named by its index and field: ``items[3].label: …``."""
    if not isinstance(data, dict):
        raise ValidationError({"body": "must be a JSON object"})
    if "items" not in data:
        single = FeedbackItemSerializer(data=data)
        single.is_valid(raise_exception=True)
        return [single.validated_data]
    if set(data) & {"request_id", "label"}:
        raise ValidationError({"items": "send either items or one request_id and label"})
    bulk = FeedbackBulkSerializer(data=data)
    bulk.is_valid(raise_exception=True)
    items = FeedbackItemSerializer(data=bulk.validated_data["items"], many=True)
    if not items.is_valid():
        # DRF reports a list's errors as {index: {field: problems}}, bad items only.
        raise ValidationError(
            {
                f"items[{i}]" if name == "non_field_errors" else f"items[{i}].{name}": problems
                for i, errors in items.errors.items()
                for name, problems in errors.items()
            }
        )
    return items.validated_data


class FeedbackView(APIView):
    permission_classes = [TenantRolePermission]
    # Labels are data an application sends beside its predictions, with its inference key.
    write_scope = "predict"
    parser_classes = [JSONBodyParser]

    @extend_schema(
        request=FeedbackItemSerializer,
        responses=FeedbackResultSerializer,
        examples=[
            OpenApiExample("one", value={"request_id": "req-1", "label": 1}),
            OpenApiExample(
                "bulk",
                value={
                    "items": [{"request_id": "a", "label": 0}, {"request_id": "b", "label": [1, 0]}]
                },
            ),
        ],
        description="Ground-truth labels by request id (the `x-request-id` of the prediction), "
        "one or up to 10 000 in `items`. A label sent again replaces the old one.",
    )
    def post(self, request: CallerRequest) -> Response:
        accepted, matched = quality.record_feedback(
            request.caller.tenant_id, feedback_items(request.data)
        )
        return Response({"accepted": accepted, "matched": matched})


class PredictionFilter(serializers.Serializer[Any]):
    version = serializers.IntegerField(max_value=MAX_INT, required=False, min_value=1)
    status = serializers.IntegerField(required=False, min_value=100, max_value=599)
    request_id = serializers.CharField(required=False, max_length=128)
    since = serializers.DateTimeField(required=False, help_text="default: the whole log")
    until = serializers.DateTimeField(required=False)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=500, default=50)
    offset = serializers.IntegerField(max_value=MAX_INT, required=False, min_value=0, default=0)


class PredictionLogSerializer(serializers.Serializer[Any]):
    """One logged request (``quality.LoggedRequest``)."""

    request_id = serializers.CharField()
    trace_id = serializers.CharField()
    version = serializers.IntegerField(allow_null=True)
    arm = serializers.CharField()
    status = serializers.IntegerField()
    latency_ms = serializers.FloatField()
    created_at = serializers.DateTimeField()
    inputs = serializers.JSONField(help_text="{column: [value per row]}, personal fields redacted")
    outputs = serializers.JSONField()
    scores = serializers.ListField(child=serializers.FloatField(allow_null=True))
    # DRF moves declared fields off the class; the stubs see them shadow Field.label.
    label = serializers.JSONField(allow_null=True)  # type: ignore[assignment]


class PredictionPageSerializer(serializers.Serializer[Any]):
    count = serializers.IntegerField()
    results = PredictionLogSerializer(many=True)


class PredictionListView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[PredictionFilter], responses=PredictionPageSerializer)
    def get(self, request: CallerRequest, name: str) -> Response:
        model = _model(request, name)
        where = PredictionFilter(data=request.query_params)
        where.is_valid(raise_exception=True)
        params = dict(where.validated_data)
        limit, offset = params.pop("limit"), params.pop("offset")
        rows = quality.logged_predictions(model, **params)
        page = rows.page(offset, limit)
        return Response(
            {"count": rows.count(), "results": PredictionLogSerializer(page, many=True).data}
        )


class ExportFilter(serializers.Serializer[Any]):
    format = serializers.ChoiceField(choices=quality.EXPORT_FORMATS, default="csv")
    since = serializers.DateTimeField(required=False, help_text="default: 24 hours before until")
    until = serializers.DateTimeField(required=False, help_text="default: now")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        since, until = attrs.get("since"), attrs.get("until")
        if since and until and since > until:
            raise ValidationError({"since": "must not be after until"})
        return attrs


def export_response(model: Model, where: dict[str, Any]) -> FileResponse:
    """The model's log over a time range as a download (CSV or Parquet)."""
    fmt = where["format"]
    body = quality.export_log(model, fmt, where.get("since"), where.get("until"))
    content_type = "text/csv" if fmt == "csv" else "application/vnd.apache.parquet"
    return FileResponse(
        body,
        as_attachment=True,
        filename=f"{model.name}-predictions.{fmt}",
        content_type=content_type,
    )


class PredictionExportView(ExportFormatParam, APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(
        parameters=[ExportFilter],
        responses={(200, "text/csv"): bytes, (200, "application/vnd.apache.parquet"): bytes},
        description="The model's logged predictions over a time range (default: the last 24 "
        "hours), oldest first, as CSV or Parquet: the request's fields, its version number, "
        "the JSON `inputs`/`outputs`, `scores` and one `f.<feature>` column per numeric feature.",
    )
    def get(self, request: CallerRequest, name: str) -> FileResponse:
        model = _model(request, name)
        where = ExportFilter(data=request.query_params)
        where.is_valid(raise_exception=True)
        return export_response(model, where.validated_data)


class QualityFilter(serializers.Serializer[Any]):
    bucket = serializers.ChoiceField(choices=quality.BUCKETS, default="hour")
    since = serializers.DateTimeField(
        required=False, help_text="default: 24 hours ago (hourly) or 30 days ago (daily)"
    )


class QualityPointSerializer(serializers.Serializer[Any]):
    bucket_start = serializers.DateTimeField()
    version = serializers.IntegerField()
    arm = serializers.CharField()
    logged = serializers.IntegerField(help_text="successful requests logged")
    labelled = serializers.IntegerField(help_text="of those, requests with a label")
    labelled_rows = serializers.IntegerField(help_text="rows those labels cover (the metrics')")
    accuracy = serializers.FloatField(required=False, allow_null=True)
    auc = serializers.FloatField(required=False, allow_null=True)
    mae = serializers.FloatField(required=False, allow_null=True)


class QualitySerializer(serializers.Serializer[Any]):
    model = serializers.CharField()
    task = serializers.CharField()
    bucket = serializers.CharField()
    since = serializers.DateTimeField()
    series = QualityPointSerializer(many=True)


class QualityView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[QualityFilter], responses=QualitySerializer)
    def get(self, request: CallerRequest, name: str) -> Response:
        model = _model(request, name)
        where = QualityFilter(data=request.query_params)
        where.is_valid(raise_exception=True)
        bucket = where.validated_data["bucket"]
        since = where.validated_data.get("since") or timezone.now() - DEFAULT_SINCE[bucket]
        series = quality.online_quality(request.caller.tenant_id, model, since, bucket)
        body = {
            "model": model.name,
            "task": model.task,
            "bucket": bucket,
            "since": since,
            "series": series,
        }
        return Response(QualitySerializer(body).data)
