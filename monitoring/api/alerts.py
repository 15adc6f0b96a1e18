"""Alerts over the API: list and read the tenant's alerts, resolve one by hand (audited), and the
tenant's webhook URL. Every lookup is tenant-scoped; viewers read alerts but neither resolve
them nor see the webhook URL (a Slack webhook URL is itself a credential)."""

from __future__ import annotations

from typing import Any, cast

from django.core.validators import URLValidator
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import validated
from platform_site.parsers import JSONBodyParser
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of
from tenants.models import WRITE_ROLES, Tenant

from ..alerts import alert_for, alerts_of, resolve_by_hand, set_webhook_url
from ..models import Alert, AlertKind

# Serializers ---------------------------------------------------------------------------------


class AlertSerializer(serializers.ModelSerializer[Alert]):
    model = serializers.CharField(source="model.name", read_only=True, allow_null=True)
    state = serializers.SerializerMethodField()

    class Meta:
        model = Alert
        fields = [
            "id",
            "kind",
            "severity",
            "state",
            "model",
            "key",
            "title",
            "message",
            "details",
            "created_at",
            "last_seen_at",
            "resolved_at",
            "webhook_state",
            "webhook_attempts",
            "webhook_error",
        ]
        read_only_fields = fields

    def get_state(self, alert: Alert) -> str:
        return "open" if alert.resolved_at is None else "resolved"


class AlertFilter(serializers.Serializer[Any]):
    state = serializers.ChoiceField(choices=["open", "resolved", "all"], default="open")
    kind = serializers.ChoiceField(choices=AlertKind.choices, required=False)
    model = serializers.CharField(required=False, help_text="model name")
    limit = serializers.IntegerField(min_value=1, max_value=1000, default=200)


class ResolveSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=500)


class AlertSettingsSerializer(serializers.Serializer[Any]):
    webhook_url = serializers.URLField(
        max_length=500,
        allow_blank=True,
        validators=[URLValidator(schemes=["http", "https"])],
        help_text="alerts are posted here as Slack-compatible JSON; empty: no webhook",
    )


# Views ---------------------------------------------------------------------------------------


def filtered(alerts: QuerySet[Alert], where: dict[str, Any]) -> QuerySet[Alert]:
    state = where["state"]
    if state != "all":
        alerts = alerts.filter(resolved_at__isnull=state == "open")
    if "kind" in where:
        alerts = alerts.filter(kind=where["kind"])
    if "model" in where:
        alerts = alerts.filter(model__name=where["model"])
    return alerts[: where["limit"]]


class AlertListView(APIView):
    """The tenant's alerts, newest first: open ones by default."""

    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[AlertFilter], responses=AlertSerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        where = validated(AlertFilter, request.query_params)
        found = filtered(alerts_of(request.caller.tenant_id), where)
        return Response(AlertSerializer(found, many=True).data)


class AlertDetailView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses=AlertSerializer)
    def get(self, request: CallerRequest, alert_id: int) -> Response:
        alert = alert_for(request.caller.tenant_id, alert_id)
        return Response(AlertSerializer(alert).data)


class AlertResolveView(APIView):
    """Resolve an open alert (engineers and approvers). A condition that still holds is
    raised again by its job's next run, as a new alert."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(request=ResolveSerializer, responses=AlertSerializer)
    def post(self, request: CallerRequest, alert_id: int) -> Response:
        body = validated(ResolveSerializer, request.data)
        alert = alert_for(request.caller.tenant_id, alert_id)
        resolved = resolve_by_hand(alert, actor_of(request), body["reason"])
        return Response(AlertSerializer(resolved).data)


class AlertSettingsView(APIView):
    """The tenant's alert webhook. Engineers and approvers only, reading included."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # checks TenantRolePermission: sets the caller
        if cast(CallerRequest, request).caller.role not in WRITE_ROLES:
            raise PermissionDenied("the webhook URL is for engineers and approvers only")

    @extend_schema(responses=AlertSettingsSerializer)
    def get(self, request: CallerRequest) -> Response:
        tenant = Tenant.objects.get(pk=request.caller.tenant_id)
        return Response({"webhook_url": tenant.alert_webhook_url})

    @extend_schema(request=AlertSettingsSerializer, responses=AlertSettingsSerializer)
    def put(self, request: CallerRequest) -> Response:
        body = validated(AlertSettingsSerializer, request.data)
        tenant = set_webhook_url(request.caller.tenant_id, body["webhook_url"], actor_of(request))
        return Response({"webhook_url": tenant.alert_webhook_url})
