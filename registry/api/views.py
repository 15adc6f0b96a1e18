"""Registry endpoints: thin views over registry.services, every lookup tenant-scoped."""

from __future__ import annotations

from contextlib import nullcontext

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.errors import NotFound
from platform_site.parsers import JSONBodyParser
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of

from .. import services
from ..access import alias_for, model_for, models_of, version_for
from ..artifact_refs import register_by_reference
from ..python_package import package_summary
from ..quantize import quantize_version
from ..reference import set_reference_upload
from .serializers import (
    AliasChangeSerializer,
    ModelSerializer,
    ServingSettingsSerializer,
    VersionSerializer,
    VersionUploadSerializer,
)


class ModelListView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses=ModelSerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        models = models_of(request.caller.tenant_id)
        return Response(ModelSerializer(models, many=True).data)

    @extend_schema(request=ModelSerializer, responses={201: ModelSerializer})
    def post(self, request: CallerRequest) -> Response:
        serializer = ModelSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        settings = dict(serializer.validated_data)
        name, task = settings.pop("name"), settings.pop("task")
        # The same audited function as the web UI's form (a taken name is a 400 naming it).
        model = services.create_model(
            request.caller.tenant_id, actor_of(request), name, task, **settings
        )
        return Response(ModelSerializer(model).data, status=status.HTTP_201_CREATED)


class VersionListView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(responses=VersionSerializer(many=True))
    def get(self, request: CallerRequest, name: str) -> Response:
        versions = model_for(request.caller.tenant_id, name).versions.select_related(
            "model", "parent"
        )
        return Response(VersionSerializer(versions, many=True).data)

    @extend_schema(request=VersionUploadSerializer, responses={201: VersionSerializer})
    def post(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        upload = VersionUploadSerializer(data=request.data)
        upload.is_valid(raise_exception=True)
        data = dict(upload.validated_data)
        artifact = data.pop("artifact", None)  # on disk past FILE_UPLOAD_MAX_MEMORY_SIZE
        uri = data.pop("artifact_uri", None)
        if "parent" in data:
            data["parent"] = version_for(model, data["parent"])
        reference = data.pop("reference", None)
        actor = actor_of(request)
        # A reference that does not fit the version undoes it; without one, no transaction
        # holds the database's write lock while the artifact is checked (seconds for textgen).
        with transaction.atomic() if reference is not None else nullcontext():
            data["created_by_id"] = request.caller.user_id
            if uri is not None:
                version = register_by_reference(model, uri, actor=actor, **data)
            else:
                version = services.create_version(model, artifact, actor=actor, **data)
            if reference is not None:
                try:
                    set_reference_upload(version, actor, **reference)
                except DjangoValidationError as exc:
                    raise ValidationError({"reference": exc.messages}) from None
        return Response(VersionSerializer(version).data, status=status.HTTP_201_CREATED)


class QuantizeView(APIView):
    """An INT8 variant of an ONNX version, as the model's next version (``registry.quantize``):
    measured against the original on a sample before it is kept, canaried like any other."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(request=None, responses={201: VersionSerializer})
    def post(self, request: CallerRequest, name: str, version: int) -> Response:
        found = version_for(model_for(request.caller.tenant_id, name), version)
        made = quantize_version(found, actor_of(request), request.caller.user_id)
        return Response(VersionSerializer(made).data, status=status.HTTP_201_CREATED)


class VersionDetailView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=VersionSerializer)
    def get(self, request: CallerRequest, name: str, version: int) -> Response:
        return Response(
            VersionSerializer(version_for(model_for(request.caller.tenant_id, name), version)).data
        )

    @extend_schema(request=ServingSettingsSerializer, responses=VersionSerializer)
    def patch(self, request: CallerRequest, name: str, version: int) -> Response:
        found = version_for(model_for(request.caller.tenant_id, name), version)
        if not isinstance(request.data, dict):
            raise ValidationError({"body": "must be a JSON object"})
        immutable = sorted(set(request.data) - set(services.SERVING_FIELDS))
        if immutable:
            raise ValidationError(
                {f: "model versions are immutable; this field cannot change" for f in immutable}
            )
        changes = ServingSettingsSerializer(data=request.data, partial=True)
        changes.is_valid(raise_exception=True)
        updated = services.update_serving_settings(
            found, dict(changes.validated_data), actor_of(request)
        )
        return Response(VersionSerializer(updated).data)

    @extend_schema(
        request=None, responses={400: None}, description="Always 400: versions are immutable."
    )
    def put(self, request: CallerRequest, name: str, version: int) -> Response:
        version_for(model_for(request.caller.tenant_id, name), version)
        raise ValidationError(
            {"version": "model versions are immutable; upload a new version instead"}
        )


class PackageView(APIView):
    """What a python version's package holds (``registry.python_package``): files, pinned
    requirements, wheels and the manifest's entrypoint, resources and policy."""

    permission_classes = [TenantRolePermission]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: CallerRequest, name: str, version: int) -> Response:
        found = version_for(model_for(request.caller.tenant_id, name), version)
        summary = package_summary(found)
        if summary is None:
            raise NotFound(f"version {version} of {name!r} is not a python package")
        return Response(summary)


class AliasHistoryView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses=AliasChangeSerializer(many=True))
    def get(self, request: CallerRequest, name: str, alias: str) -> Response:
        """An alias's moves, newest first (break-glass rollbacks flagged until reviewed)."""
        model = model_for(request.caller.tenant_id, name)
        alias_for(model, alias)
        history = services.alias_history(model, alias)[:HISTORY_LIMIT]
        return Response(AliasChangeSerializer(history, many=True).data)


# The most entries the history endpoint and page show (newest first).
HISTORY_LIMIT = 500
