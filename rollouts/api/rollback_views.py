"""Break-glass rollback endpoints: thin views over ``rollouts.rollback``, every lookup
tenant-scoped (another tenant's model is the same 404 as a missing one)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import MAX_INT, validated
from platform_site.parsers import JSONBodyParser
from registry.access import model_for
from registry.api.serializers import AliasChangeSerializer
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of

from ..rollback import change_for, review_rollback, rollback_alias
from .serializers import CommentSerializer


class RollbackSerializer(serializers.Serializer[Any]):
    to_version = serializers.IntegerField(
        min_value=1,
        max_value=MAX_INT,
        required=False,
        allow_null=True,
        default=None,
        help_text="A version the alias pointed at before; default: the one before its last move.",
    )
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)


class AliasRollbackView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(request=RollbackSerializer, responses={200: AliasChangeSerializer})
    def post(self, request: CallerRequest, name: str, alias: str) -> Response:
        """Break-glass: move the alias back at once, no approval (kills its active plan);
        flagged for an approver's review. 409 when already there, or when the last move was
        a rollback and no ``to_version`` is named."""
        model = model_for(request.caller.tenant_id, name)
        body = validated(RollbackSerializer, request.data)
        change = rollback_alias(model, alias, actor_of(request), body["to_version"], body["reason"])
        return Response(AliasChangeSerializer(change).data)


class AliasReviewView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(request=CommentSerializer, responses={200: AliasChangeSerializer})
    def post(self, request: CallerRequest, name: str, alias: str, change_id: int) -> Response:
        """An approver (not the person who rolled back) marks a break-glass rollback reviewed."""
        model = model_for(request.caller.tenant_id, name)
        change = change_for(model, alias, change_id)
        body = validated(CommentSerializer, request.data)
        reviewed = review_rollback(change, actor_of(request), body["comment"])
        return Response(AliasChangeSerializer(reviewed).data)
