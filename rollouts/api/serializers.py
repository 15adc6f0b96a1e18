"""DRF serializers for rollout plans, promotions and approval requests."""

from typing import Any

from rest_framework import serializers

from platform_site.api import MAX_INT

from ..approvals import evidence_of
from ..models import (
    ApprovalRequest,
    PlanMode,
    RequestKind,
    RequestState,
    RolloutPlan,
    RolloutPolicy,
)
from ..policy import REQUIRABLE_GUARDRAILS
from ..shadow import shadow_summary


class PlanSerializer(serializers.ModelSerializer[RolloutPlan]):
    model = serializers.CharField(source="model.name", read_only=True)
    baseline = serializers.IntegerField(source="baseline.version", read_only=True)
    candidate = serializers.IntegerField(source="candidate.version", read_only=True)
    arms = serializers.SerializerMethodField()
    shadow = serializers.SerializerMethodField()

    class Meta:
        model = RolloutPlan
        fields = [
            "id",
            "model",
            "alias",
            "mode",
            "state",
            "baseline",
            "candidate",
            "weight",
            "steps",
            "max_weight",
            "bake_seconds",
            "shadow_sample",
            "routing_header",
            "guardrails",
            "arms",
            "shadow",
            "status_note",
            "ab_result",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_shadow(self, plan: RolloutPlan) -> dict[str, Any] | None:
        return shadow_summary(plan) if plan.mode == PlanMode.SHADOW else None

    def get_arms(self, plan: RolloutPlan) -> list[dict[str, Any]]:
        return [
            {"name": a.name, "version": a.version.version, "weight": a.weight}
            for a in plan.arms.select_related("version")
        ]


class ArmInput(serializers.Serializer[Any]):
    name = serializers.CharField(max_length=50)
    version = serializers.IntegerField(max_value=MAX_INT, min_value=1)
    weight = serializers.FloatField(min_value=0, max_value=100)


class PlanCreateSerializer(serializers.Serializer[Any]):
    mode = serializers.ChoiceField(choices=PlanMode.choices)
    candidate = serializers.IntegerField(max_value=MAX_INT, min_value=1, help_text="version number")
    alias = serializers.CharField(max_length=50, default="production")
    weight = serializers.FloatField(min_value=0, max_value=100, default=0)
    steps = serializers.ListField(
        child=serializers.FloatField(min_value=0, max_value=100), required=False
    )
    max_weight = serializers.FloatField(
        min_value=0,
        max_value=100,
        required=False,
        help_text="highest weight a person may set directly; above it needs an approval "
        "(capped by the rollout policy's max_weight_without_approval on a protected alias)",
    )
    bake_seconds = serializers.IntegerField(max_value=MAX_INT, min_value=0, required=False)
    shadow_sample = serializers.FloatField(min_value=0, max_value=1, required=False)
    routing_header = serializers.CharField(max_length=100, required=False)
    guardrails = serializers.JSONField()
    arms = ArmInput(many=True, required=False)


class WeightSerializer(serializers.Serializer[Any]):
    weight = serializers.FloatField(min_value=0, max_value=100)
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class ReasonSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class ApprovalSerializer(serializers.ModelSerializer[ApprovalRequest]):
    model = serializers.CharField(source="model.name", read_only=True)
    from_version = serializers.IntegerField(
        source="from_version.version", read_only=True, allow_null=True
    )
    to_version = serializers.IntegerField(source="to_version.version", read_only=True)
    requested_by = serializers.CharField(source="requested_label", read_only=True)
    decided_by = serializers.CharField(source="decided_label", read_only=True)
    evidence = serializers.SerializerMethodField()
    approvals = serializers.IntegerField(
        source="approvals_given", read_only=True, help_text="approvers who said yes so far"
    )
    votes = serializers.SerializerMethodField()

    class Meta:
        model = ApprovalRequest
        fields = [
            "id",
            "kind",
            "state",
            "model",
            "alias",
            "plan",
            "from_version",
            "to_version",
            "weight",
            "arm_weights",
            "requested_by",
            "comment",
            "approvals",
            "approvals_needed",
            "votes",
            "decided_by",
            "decision_comment",
            "decided_at",
            "created_at",
            "evidence",
        ]
        read_only_fields = fields

    def get_votes(self, req: ApprovalRequest) -> list[dict[str, Any]]:
        return [
            {"by": v.label, "approved": v.approved, "comment": v.comment, "at": v.at}
            for v in req.votes.all()
        ]

    def get_evidence(self, req: ApprovalRequest) -> dict[str, Any] | None:
        # Lists stay cheap: the evidence (several aggregate queries) is on the detail view.
        return evidence_of(req) if self.context.get("with_evidence") else None


class ApprovalFilter(serializers.Serializer[Any]):
    state = serializers.ChoiceField(choices=RequestState.choices, required=False)
    kind = serializers.ChoiceField(choices=RequestKind.choices, required=False)
    model = serializers.CharField(required=False)


class PromotionSerializer(serializers.Serializer[Any]):
    version = serializers.IntegerField(max_value=MAX_INT, min_value=1)
    alias = serializers.CharField(max_length=50, default="production")
    comment = serializers.CharField(required=False, allow_blank=True, default="")


class CommentSerializer(serializers.Serializer[Any]):
    comment = serializers.CharField(required=False, allow_blank=True, default="")


class ArmMetricsSerializer(serializers.Serializer[Any]):
    arm = serializers.CharField()
    version = serializers.IntegerField()
    weight = serializers.FloatField()
    requests = serializers.IntegerField()
    # DRF moves declared fields off the class; the stubs see them shadow Serializer.errors.
    errors = serializers.IntegerField()  # type: ignore[assignment]
    error_rate = serializers.FloatField()
    p50_ms = serializers.FloatField(allow_null=True)
    p95_ms = serializers.FloatField(allow_null=True)
    p99_ms = serializers.FloatField(allow_null=True, help_text="null: above the last bucket")


class PlanMetricsSerializer(serializers.Serializer[Any]):
    plan = serializers.IntegerField()
    arms = ArmMetricsSerializer(many=True)
    diff = serializers.JSONField(
        allow_null=True,
        help_text="candidate minus baseline (error_rate, p50_ms, p95_ms, p99_ms) and each side's "
        "requests (n); with no "
        'requests on a side: {"not_enough_data": true, "n": {"baseline": …, "candidate": …}, '
        '"need": 1}',
    )


class ArmWeightsSerializer(serializers.Serializer[Any]):
    arms = serializers.DictField(
        child=serializers.FloatField(min_value=0, max_value=100),
        help_text="every arm's new weight: {arm name: percent}",
    )
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class PolicySerializer(serializers.ModelSerializer[RolloutPolicy]):
    scope = serializers.SerializerMethodField(
        help_text="model (its own policy), tenant (the tenant's default) or default (built in)"
    )
    model = serializers.SerializerMethodField()
    updated_by = serializers.SerializerMethodField()
    updated_at = serializers.DateTimeField(
        read_only=True, allow_null=True, help_text="null: the built-in defaults"
    )

    class Meta:
        model = RolloutPolicy
        fields = [
            "scope",
            "model",
            "max_weight_without_approval",
            "required_guardrails",
            "approvals_needed",
            "protected_aliases",
            "updated_by",
            "updated_at",
        ]
        read_only_fields = fields

    def get_scope(self, policy: RolloutPolicy) -> str:
        if policy.pk is None:
            return "default"
        return "model" if policy.model_id else "tenant"

    def get_model(self, policy: RolloutPolicy) -> str | None:
        return policy.model.name if policy.model is not None else None

    def get_updated_by(self, policy: RolloutPolicy) -> str | None:
        return policy.updated_by.get_username() if policy.updated_by is not None else None


class PolicyInputSerializer(serializers.Serializer[Any]):
    """Fields left out keep their current value."""

    max_weight_without_approval = serializers.FloatField(min_value=0, max_value=100, required=False)
    required_guardrails = serializers.ListField(
        child=serializers.ChoiceField(choices=REQUIRABLE_GUARDRAILS), required=False
    )
    approvals_needed = serializers.IntegerField(min_value=1, max_value=10, required=False)
    protected_aliases = serializers.ListField(
        child=serializers.CharField(max_length=50), required=False
    )
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class FreezeOverrideSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(help_text="why releases may go on with the budget spent")
    hours = serializers.FloatField(
        min_value=0.01, max_value=168, default=4, help_text="how long the override holds"
    )


class FreezeStatusSerializer(serializers.Serializer[Any]):
    model = serializers.CharField()
    frozen = serializers.BooleanField()
    budget_spent = serializers.ListField(child=serializers.CharField())
    override = serializers.DictField(allow_null=True)
