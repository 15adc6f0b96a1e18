"""MLflow import: register a version from an MLflow registry, then ask for its alias."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.parsers import JSONBodyParser
from registry.access import model_for
from registry.api.serializers import VersionSerializer
from registry.mlflow_import import import_version
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of

from ..approvals import move_alias
from ..models import ApprovalRequest
from .serializers import ApprovalSerializer


class MlflowImportSerializer(serializers.Serializer[Any]):
    # The metaclass moves declared fields off the class: "source" shadows nothing at runtime.
    source = serializers.CharField(max_length=600)  # type: ignore[assignment]
    tracking_uri = serializers.CharField(max_length=1000, required=False, allow_blank=True)
    alias = serializers.SlugField(max_length=64, required=False)


class MlflowImportView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(request=MlflowImportSerializer, responses={201: VersionSerializer})
    def post(self, request: CallerRequest, name: str) -> Response:
        """Import ``models:/name/N`` or ``models:/name@alias``; an alias asked for (or the
        MLflow alias imported) moves through the approval rules like any alias move."""
        model = model_for(request.caller.tenant_id, name)
        body = MlflowImportSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        actor = actor_of(request)
        version, mlflow_alias = import_version(
            model,
            body.validated_data["source"],
            body.validated_data.get("tracking_uri") or None,
            actor,
            created_by_id=request.caller.user_id,
        )
        data: dict[str, Any] = {"version": VersionSerializer(version).data}
        alias = body.validated_data.get("alias") or mlflow_alias
        if alias:
            moved = move_alias(model, alias, version, actor, f"imported from MLflow {version}")
            if isinstance(moved, ApprovalRequest):
                data["approval"] = ApprovalSerializer(moved).data
            else:
                data["alias"] = {"name": moved.name, "version": version.version}
        return Response(data, status=status.HTTP_201_CREATED)
