"""Rollout endpoints: thin views over rollouts.actions, every lookup tenant-scoped."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import validated
from platform_site.parsers import JSONBodyParser
from registry import services as registry_services
from registry.access import model_for, version_for
from registry.api.serializers import AliasSerializer, ModelSerializer, ModelUpdateSerializer
from tenants.audit import Actor
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of

from .. import actions, approvals, gate, policy
from ..access import approval_for, approvals_of, plan_for
from ..approvals import move_alias
from ..arms import metrics_diff, plan_arm_metrics
from ..models import ApprovalRequest, RolloutPlan
from .serializers import (
    ApprovalFilter,
    ApprovalSerializer,
    ArmWeightsSerializer,
    CommentSerializer,
    FreezeOverrideSerializer,
    FreezeStatusSerializer,
    PlanCreateSerializer,
    PlanMetricsSerializer,
    PlanSerializer,
    PolicyInputSerializer,
    PolicySerializer,
    PromotionSerializer,
    ReasonSerializer,
    WeightSerializer,
)


def approval_response(req: ApprovalRequest) -> Response:
    """202: the change waits for an approver."""
    data = ApprovalSerializer(req, context={"with_evidence": True}).data
    return Response(data, status=status.HTTP_202_ACCEPTED)


class PlanListView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=PlanSerializer(many=True))
    def get(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        return Response(PlanSerializer(model.plans.all(), many=True).data)

    @extend_schema(
        request=PlanCreateSerializer, responses={201: PlanSerializer, 202: ApprovalSerializer}
    )
    def post(self, request: CallerRequest, name: str) -> Response:
        """Start a plan. A start the traffic gate does not clear starts held (a canary at the
        policy's limit, A/B arms of unapproved versions at 0 %) and what was asked for waits
        for an approver: 202 with that request."""
        model = model_for(request.caller.tenant_id, name)
        body = PlanCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)

        candidate = version_for(model, data.pop("candidate"))
        arms = [
            (a["name"], version_for(model, a["version"]), a["weight"]) for a in data.pop("arms", [])
        ]
        plan, asked = approvals.start_plan(
            model,
            data.pop("mode"),
            candidate,
            data.pop("guardrails"),
            actor_of(request),
            arms=arms,
            **data,
        )
        if asked is not None:
            return approval_response(asked)
        return Response(PlanSerializer(plan).data, status=status.HTTP_201_CREATED)


class PlanDetailView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses=PlanSerializer)
    def get(self, request: CallerRequest, plan_id: int) -> Response:
        return Response(PlanSerializer(plan_for(request.caller.tenant_id, plan_id)).data)


def plan_or_request(done: RolloutPlan | ApprovalRequest) -> Response:
    """A change applied at once (200, the plan) or sent for approval (202, the request)."""
    if isinstance(done, ApprovalRequest):
        return approval_response(done)
    return Response(PlanSerializer(done).data)


class PlanWeightView(APIView):
    """Set a canary's weight: applied within the plan's ``max_weight``, above it a request."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(
        request=WeightSerializer, responses={200: PlanSerializer, 202: ApprovalSerializer}
    )
    def post(self, request: CallerRequest, plan_id: int) -> Response:
        body = validated(WeightSerializer, request.data)
        plan = plan_for(request.caller.tenant_id, plan_id)
        return plan_or_request(
            approvals.change_weight(plan, body["weight"], actor_of(request), body["reason"])
        )


class PlanArmsView(APIView):
    """New weights for an A/B plan's arms: on a protected alias an arms request (202)."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(
        request=ArmWeightsSerializer, responses={200: PlanSerializer, 202: ApprovalSerializer}
    )
    def post(self, request: CallerRequest, plan_id: int) -> Response:
        body = validated(ArmWeightsSerializer, request.data)
        plan = plan_for(request.caller.tenant_id, plan_id)
        return plan_or_request(
            approvals.change_arms(plan, body["arms"], actor_of(request), body["reason"])
        )


class PlanActionView(APIView):
    """A one-step plan action with an optional reason: kill, pause or resume."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]
    change: staticmethod[[RolloutPlan, Actor, str], RolloutPlan]  # set by each subclass

    @extend_schema(request=ReasonSerializer, responses=PlanSerializer)
    def post(self, request: CallerRequest, plan_id: int) -> Response:
        body = validated(ReasonSerializer, request.data)
        plan = plan_for(request.caller.tenant_id, plan_id)
        changed = self.change(plan, actor_of(request), body["reason"])
        return Response(PlanSerializer(changed).data)


class PlanKillView(PlanActionView):
    """The kill switch: 100 % of traffic back to the baseline at once."""

    change = staticmethod(actions.kill)


class PlanPauseView(PlanActionView):
    """Hold the split; the guardrails leave a paused plan alone."""

    change = staticmethod(actions.pause)


class PlanResumeView(PlanActionView):
    change = staticmethod(actions.resume)


class PlanPromotionView(APIView):
    """Ask for the plan's candidate to be promoted; an approver decides."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(request=CommentSerializer, responses={202: ApprovalSerializer})
    def post(self, request: CallerRequest, plan_id: int) -> Response:
        body = validated(CommentSerializer, request.data)
        plan = plan_for(request.caller.tenant_id, plan_id)
        req = approvals.request_promotion(
            plan.model,
            None,
            actor_of(request),
            alias=plan.alias,
            comment=body["comment"],
            plan=plan,
        )
        return approval_response(req)


class PlanMetricsView(APIView):
    """Per-arm request counts, error rates and latency percentiles since the plan started (or
    since its current step, with ``?window=step``), and the candidate-minus-baseline diff."""

    permission_classes = [TenantRolePermission]

    @extend_schema(responses=PlanMetricsSerializer)
    def get(self, request: CallerRequest, plan_id: int) -> Response:
        plan = plan_for(request.caller.tenant_id, plan_id)
        since = plan.step_started_at if request.query_params.get("window") == "step" else None
        arms = plan_arm_metrics(plan, since)
        return Response({"plan": plan.pk, "arms": arms, "diff": metrics_diff(arms)})


class PromotionListView(APIView):
    """Ask to point an alias at a version without a plan: a promotion request."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(request=PromotionSerializer, responses={202: ApprovalSerializer})
    def post(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        body = validated(PromotionSerializer, request.data)
        version = version_for(model, body["version"])
        req = approvals.request_promotion(
            model, version, actor_of(request), alias=body["alias"], comment=body["comment"]
        )
        return approval_response(req)


class ApprovalListView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[ApprovalFilter], responses=ApprovalSerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        where = validated(ApprovalFilter, request.query_params)
        found = approvals_of(request.caller.tenant_id)
        if "model" in where:
            found = found.filter(model__name=where.pop("model"))
        found = found.filter(**where)
        return Response(ApprovalSerializer(found[:200], many=True).data)


class ApprovalDetailView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses=ApprovalSerializer)
    def get(self, request: CallerRequest, request_id: int) -> Response:
        req = approval_for(request.caller.tenant_id, request_id)
        return Response(ApprovalSerializer(req, context={"with_evidence": True}).data)


class ApprovalDecisionView(APIView):
    """Approve or reject: an approver who is not the requester; 409 when it lost a race."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]
    # set by each subclass
    decide: staticmethod[[ApprovalRequest, Actor, str], ApprovalRequest]

    @extend_schema(request=CommentSerializer, responses=ApprovalSerializer)
    def post(self, request: CallerRequest, request_id: int) -> Response:
        body = validated(CommentSerializer, request.data)
        req = approval_for(request.caller.tenant_id, request_id)
        decided = self.decide(req, actor_of(request), body["comment"])
        return Response(ApprovalSerializer(decided, context={"with_evidence": True}).data)


class ApproveView(ApprovalDecisionView):
    decide = staticmethod(approvals.approve)


class RejectView(ApprovalDecisionView):
    decide = staticmethod(approvals.reject)


class AliasView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=AliasSerializer)
    def get(self, request: CallerRequest, name: str, alias: str) -> Response:
        found = (
            model_for(request.caller.tenant_id, name)
            .aliases.select_related("version")
            .filter(name=alias)
        )
        if not found:
            raise NotFound(f"model {name!r} has no alias {alias!r}")
        return Response(AliasSerializer(found[0]).data)

    @extend_schema(
        request=AliasSerializer, responses={200: AliasSerializer, 202: ApprovalSerializer}
    )
    def put(self, request: CallerRequest, name: str, alias: str) -> Response:
        """Move an alias. Moving ``production`` once it exists is a promotion request (202)."""
        model = model_for(request.caller.tenant_id, name)
        body = AliasSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        target = version_for(model, body.validated_data["version"])
        moved = move_alias(model, alias, target, actor_of(request), body.validated_data["comment"])
        if isinstance(moved, ApprovalRequest):
            return approval_response(moved)
        return Response(AliasSerializer(moved).data)


class ModelDetailView(APIView):
    """A model, and changes to its description, monitoring settings and fallback ladder (the
    ladder through the traffic gate: ``rollouts.gate.update_model_settings``)."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=ModelSerializer)
    def get(self, request: CallerRequest, name: str) -> Response:
        return Response(ModelSerializer(model_for(request.caller.tenant_id, name)).data)

    @extend_schema(request=ModelUpdateSerializer, responses=ModelSerializer)
    def patch(self, request: CallerRequest, name: str) -> Response:
        """Change the description, the monitoring settings (sampling, retention, drift, SLOs) or
        the fallback ladder: a fallback version must be approved for the model's protected
        aliases (403 otherwise)."""
        model = model_for(request.caller.tenant_id, name)
        if not isinstance(request.data, dict):
            raise ValidationError({"body": "must be a JSON object"})
        fixed = sorted(
            set(request.data)
            - set(registry_services.MONITORING_FIELDS)
            - set(registry_services.LADDER_FIELDS)
        )
        if fixed:
            raise ValidationError(
                {f: "cannot change; a model's name and task are fixed" for f in fixed}
            )
        changes = ModelUpdateSerializer(model, data=request.data, partial=True)
        changes.is_valid(raise_exception=True)
        updated = gate.update_model_settings(model, dict(changes.validated_data), actor_of(request))
        return Response(ModelSerializer(updated).data)


class TenantPolicyView(APIView):
    """The tenant's default rollout policy: members read it, approvers set it."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=PolicySerializer)
    def get(self, request: CallerRequest) -> Response:
        return Response(PolicySerializer(policy.tenant_policy(request.caller.tenant_id)).data)

    @extend_schema(request=PolicyInputSerializer, responses=PolicySerializer)
    def put(self, request: CallerRequest) -> Response:
        body = validated(PolicyInputSerializer, request.data)
        reason = body.pop("reason")
        tenant_id = request.caller.tenant_id
        done = policy.set_policy(tenant_id, None, body, actor_of(request), reason)
        return Response(PolicySerializer(done).data)


class ModelPolicyView(APIView):
    """The policy in force for a model (its own, else the tenant's); approvers set its own."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=PolicySerializer)
    def get(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        return Response(PolicySerializer(policy.policy_for(model)).data)

    @extend_schema(request=PolicyInputSerializer, responses=PolicySerializer)
    def put(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        body = validated(PolicyInputSerializer, request.data)
        reason = body.pop("reason")
        done = policy.set_policy(model.tenant_id, model, body, actor_of(request), reason)
        return Response(PolicySerializer(done).data)


class FreezeOverrideView(APIView):
    """The model's release freeze (GET) and an approver's override of it (POST, audited)."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=FreezeStatusSerializer)
    def get(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        return Response(policy.freeze_status(model))

    @extend_schema(request=FreezeOverrideSerializer, responses={201: FreezeStatusSerializer})
    def post(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        body = validated(FreezeOverrideSerializer, request.data)
        policy.override_freeze(model, actor_of(request), body["reason"], body["hours"])
        return Response(policy.freeze_status(model), status=status.HTTP_201_CREATED)
