"""Rollout endpoints: thin views over rollouts.actions, every lookup tenant-scoped."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from registry.services import models_of
from tenants.authentication import TenantRolePermission

from .. import actions
from ..models import AuditEvent, RolloutPlan
from .serializers import (
    AuditSerializer,
    PlanCreateSerializer,
    PlanSerializer,
    ReasonSerializer,
    WeightSerializer,
)


def _actor(request) -> actions.Actor:
    caller = request.caller
    label = str(request.user) if caller.user_id is None else request.user.get_username()
    return actions.Actor(caller.user_id, label)


def _plan(request, plan_id: int) -> RolloutPlan:
    return get_object_or_404(
        RolloutPlan.objects.select_related("model", "baseline", "candidate"),
        pk=plan_id,
        model__tenant_id=request.caller.tenant_id,
    )


class PlanListView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONParser]

    @extend_schema(responses=PlanSerializer(many=True))
    def get(self, request, name: str):
        model = get_object_or_404(models_of(request.caller.tenant_id), name=name)
        return Response(PlanSerializer(model.plans.all(), many=True).data)

    @extend_schema(request=PlanCreateSerializer, responses={201: PlanSerializer})
    def post(self, request, name: str):
        model = get_object_or_404(models_of(request.caller.tenant_id), name=name)
        body = PlanCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)

        def version(number: int):
            found = model.versions.filter(version=number).first()
            if found is None:
                raise NotFound(f"model {name!r} has no version {number}")
            return found

        candidate = version(data.pop("candidate"))
        arms = [(a["name"], version(a["version"]), a["weight"]) for a in data.pop("arms", [])]
        plan = actions.start_plan(
            model,
            data.pop("mode"),
            candidate,
            data.pop("guardrails"),
            _actor(request),
            arms=arms,
            **data,
        )
        return Response(PlanSerializer(plan).data, status=status.HTTP_201_CREATED)


class PlanDetailView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses=PlanSerializer)
    def get(self, request, plan_id: int):
        return Response(PlanSerializer(_plan(request, plan_id)).data)


class PlanWeightView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONParser]

    @extend_schema(request=WeightSerializer, responses=PlanSerializer)
    def post(self, request, plan_id: int):
        body = WeightSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        plan = actions.set_weight(
            _plan(request, plan_id),
            body.validated_data["weight"],
            _actor(request),
            body.validated_data["reason"],
        )
        return Response(PlanSerializer(plan).data)


class PlanKillView(APIView):
    """The kill switch: 100 % of traffic back to the baseline at once."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONParser]

    @extend_schema(request=ReasonSerializer, responses=PlanSerializer)
    def post(self, request, plan_id: int):
        body = ReasonSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        plan = actions.kill(_plan(request, plan_id), _actor(request), body.validated_data["reason"])
        return Response(PlanSerializer(plan).data)


class AuditView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses=AuditSerializer(many=True))
    def get(self, request):
        events = AuditEvent.objects.filter(tenant_id=request.caller.tenant_id)
        action = request.query_params.get("action")
        if action:
            events = events.filter(action=action)
        return Response(AuditSerializer(events[:500], many=True).data)
