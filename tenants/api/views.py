"""The audit log over the API: the caller's tenant's events, newest first, filtered."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from ..audit import audit_events
from ..authentication import CallerRequest, TenantRolePermission
from .serializers import AuditFilter, AuditSerializer


class AuditView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[AuditFilter], responses=AuditSerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        query = AuditFilter(data=request.query_params)
        query.is_valid(raise_exception=True)
        where = query.validated_data
        events = audit_events(request.caller.tenant_id, where)[: where["limit"]]
        return Response(AuditSerializer(events, many=True).data)
