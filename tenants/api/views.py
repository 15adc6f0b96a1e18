"""The audit log over the API (the caller's tenant's events, newest first, filtered; and their
export as CSV or JSON Lines), and the tenant's API keys (list, create, revoke, rotate)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from itertools import islice
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import ExportFormatParam
from platform_site.parsers import JSONBodyParser

from ..audit import EXPORT_TYPES, audit_events, export_lines
from ..authentication import CallerRequest, KeyAdminPermission, TenantRolePermission, actor_of
from ..keys import check_grant, create_api_key, key_for, keys_of, revoke_api_key, rotate_api_key
from ..models import Tenant
from .serializers import (
    ApiKeyCreatedSerializer,
    ApiKeyCreateSerializer,
    ApiKeySerializer,
    AuditFilter,
    AuditSerializer,
    ExportFilter,
    RotateSerializer,
)


class AuditView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[AuditFilter], responses=AuditSerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        query = AuditFilter(data=request.query_params)
        query.is_valid(raise_exception=True)
        where = query.validated_data
        events = audit_events(request.caller.tenant_id, where)[: where["limit"]]
        return Response(AuditSerializer(events, many=True).data)


class AuditExportView(ExportFormatParam, APIView):
    """The whole filtered log, streamed row by row (never held in memory)."""

    permission_classes = [TenantRolePermission]

    @extend_schema(
        parameters=[ExportFilter],
        responses={
            (200, "text/csv"): OpenApiTypes.STR,
            (200, "application/x-ndjson"): OpenApiTypes.STR,
        },
    )
    def get(self, request: CallerRequest) -> StreamingHttpResponse:
        query = ExportFilter(data=request.query_params)
        query.is_valid(raise_exception=True)
        where = query.validated_data
        events = audit_events(request.caller.tenant_id, where)
        if where.get("limit"):
            events = events[: where["limit"]]
        fmt = where["format"]
        lines = export_lines(events, fmt)
        # Under ASGI Django would read a plain iterator to its end before sending a byte: an
        # asynchronous one is sent as it is read.
        body = in_batches(lines) if isinstance(request._request, ASGIRequest) else lines
        response = StreamingHttpResponse(body, content_type=EXPORT_TYPES[fmt])
        slug = Tenant.objects.filter(pk=request.caller.tenant_id).values_list("slug", flat=True)
        filename = f"audit-{slug.first()}.{fmt}"
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
        return response


async def in_batches(lines: Iterator[bytes], size: int = 500) -> AsyncIterator[bytes]:
    """The lines, read ``size`` at a time on the request's database thread (where the
    queryset's cursor lives), each batch sent before the next is read."""
    read = sync_to_async(lambda: b"".join(islice(lines, size)), thread_sensitive=True)
    while batch := await read():
        yield batch


def _shown_once(data: dict[str, Any]) -> Response:
    response = Response(data, status=status.HTTP_201_CREATED)
    response["Cache-Control"] = "no-store"  # the raw key is in this body: never cached
    return response


class KeyListView(APIView):
    permission_classes = [KeyAdminPermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=ApiKeySerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        return Response(ApiKeySerializer(keys_of(request.caller.tenant_id), many=True).data)

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeyCreatedSerializer})
    def post(self, request: CallerRequest) -> Response:
        """Create a key acting as you; its raw value is in this response only. No one gives a
        key more power than they have: engineers predict and deploy, approvers also admin, and
        a key only the scopes it holds itself."""
        body = ApiKeyCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        check_grant(request.caller.role, data["scopes"], request.caller.scopes)
        tenant = Tenant.objects.get(pk=request.caller.tenant_id)
        key, raw = create_api_key(
            tenant,
            data["name"],
            actor_of(request),
            scopes=data["scopes"],
            expires_at=data.get("expires_at"),
        )
        return _shown_once({**ApiKeySerializer(key).data, "key": raw})


class KeyRevokeView(APIView):
    permission_classes = [KeyAdminPermission]

    @extend_schema(request=None, responses=ApiKeySerializer)
    def post(self, request: CallerRequest, key_id: int) -> Response:
        key = key_for(request.caller.tenant_id, key_id)
        check_grant(request.caller.role, key.scopes, request.caller.scopes)
        return Response(ApiKeySerializer(revoke_api_key(key, actor_of(request))).data)


class KeyRotateView(APIView):
    permission_classes = [KeyAdminPermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(
        request=RotateSerializer,
        responses={201: ApiKeyCreatedSerializer, 409: OpenApiResponse(description="not active")},
    )
    def post(self, request: CallerRequest, key_id: int) -> Response:
        """A new key with the same name, scopes and limits (its raw value in this response
        only); the old one keeps working for ``overlap_s`` seconds."""
        key = key_for(request.caller.tenant_id, key_id)
        check_grant(request.caller.role, key.scopes, request.caller.scopes)
        body = RotateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        new, raw = rotate_api_key(
            key, actor_of(request), data["overlap_s"], expires_at=data.get("expires_at")
        )
        return _shown_once({**ApiKeySerializer(new).data, "key": raw})
