"""Drift over the API: a version's reference sample (read, upload, or choose a past window of
its logged predictions) and the model's drift reports. Serializers and thin views over
``monitoring.drift``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import MAX_INT, validated
from platform_site.parsers import JSONBodyParser
from registry.access import model_for, version_for
from registry.api.serializers import ReferenceUploadSerializer
from registry.models import ReferenceSample
from registry.reference import set_reference_upload
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of

from ..drift import reference_summary, set_reference_window
from ..models import DriftReport

# Serializers ---------------------------------------------------------------------------------


class ReferenceWindowSerializer(serializers.Serializer[Any]):
    """A past window of the version's own logged predictions to use as its reference."""

    window_start = serializers.DateTimeField()
    window_end = serializers.DateTimeField()


class ReferenceSerializer(serializers.ModelSerializer[ReferenceSample]):
    model = serializers.CharField(source="version.model.name", read_only=True)
    version = serializers.IntegerField(source="version.version", read_only=True)
    scores = serializers.SerializerMethodField(help_text="rows that carry a score")
    features = serializers.SerializerMethodField(
        help_text="per feature: kind, type, values, nulls, and min/max/mean or categories"
    )
    uploaded_by = serializers.CharField(source="uploaded_by.username", default=None)

    class Meta:
        model = ReferenceSample
        fields = [
            "model",
            "version",
            "source",
            "rows",
            "scores",
            "window_start",
            "window_end",
            "uploaded_by",
            "created_at",
            "features",
        ]
        read_only_fields = fields

    def get_scores(self, sample: ReferenceSample) -> int:
        return sum(s is not None for s in sample.scores)

    def get_features(self, sample: ReferenceSample) -> dict[str, dict[str, Any]]:
        return reference_summary(sample)


class DriftReportSerializer(serializers.ModelSerializer[DriftReport]):
    version = serializers.IntegerField(source="version.version", read_only=True)
    features = serializers.JSONField(
        help_text="per feature: kind, psi, ks and ks_pvalue (numeric) or distance (categorical, "
        'Jensen-Shannon), flagged, and histograms: "edges" or "categories" with "reference" '
        'and "current" shares'
    )
    score = serializers.JSONField(help_text="the same on the output scores (null if none)")
    quality = serializers.JSONField(
        help_text="per feature: nulls, out_of_range and schema violations in the window"
    )

    class Meta:
        model = DriftReport
        fields = [
            "id",
            "version",
            "created_at",
            "window_start",
            "window_end",
            "reference_source",
            "rows_current",
            "rows_reference",
            "threshold",
            "max_psi",
            "flagged",
            "features",
            "score",
            "quality",
        ]
        read_only_fields = fields


class DriftFilter(serializers.Serializer[Any]):
    version = serializers.IntegerField(max_value=MAX_INT, min_value=1, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=500, default=50)


# Views ---------------------------------------------------------------------------------------


class ReferenceView(APIView):
    """A version's drift reference: what it is (GET), an uploaded sample (PUT), or a past window
    of its logged predictions (POST). Either write replaces the reference and is audited."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(summary="The version's drift reference", responses=ReferenceSerializer)
    def get(self, request: CallerRequest, name: str, version: int) -> Response:
        found = version_for(model_for(request.caller.tenant_id, name), version)
        sample = ReferenceSample.objects.filter(version=found).first()
        if sample is None:
            raise NotFound(f"{name} v{version} has no drift reference yet")
        return Response(ReferenceSerializer(sample).data)

    @extend_schema(
        summary="Upload a reference sample (rows or columns)",
        request=ReferenceUploadSerializer,
        responses=ReferenceSerializer,
    )
    def put(self, request: CallerRequest, name: str, version: int) -> Response:
        found = version_for(model_for(request.caller.tenant_id, name), version)
        body = validated(ReferenceUploadSerializer, request.data)
        sample = set_reference_upload(found, actor_of(request), **body)
        return Response(ReferenceSerializer(sample).data)

    @extend_schema(
        summary="Use a past window of the version's logged predictions as its reference",
        request=ReferenceWindowSerializer,
        responses=ReferenceSerializer,
    )
    def post(self, request: CallerRequest, name: str, version: int) -> Response:
        found = version_for(model_for(request.caller.tenant_id, name), version)
        body = validated(ReferenceWindowSerializer, request.data)
        sample = set_reference_window(
            found, body["window_start"], body["window_end"], actor_of(request)
        )
        return Response(ReferenceSerializer(sample).data)


class DriftReportListView(APIView):
    """The model's drift reports, newest first (``?version=N`` for one version)."""

    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[DriftFilter], responses=DriftReportSerializer(many=True))
    def get(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        where = validated(DriftFilter, request.query_params)
        reports = DriftReport.objects.filter(model=model).select_related("version")
        if "version" in where:
            reports = reports.filter(version=version_for(model, where["version"]))
        found = reports.order_by("-created_at")[: where["limit"]]
        return Response(DriftReportSerializer(found, many=True).data)
