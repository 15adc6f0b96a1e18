"""DRF serializers for rollout plans, promotions and approval requests."""

from rest_framework import serializers

from ..approvals import evidence_of
from ..models import ApprovalRequest, PlanMode, RequestKind, RequestState, RolloutPlan
from ..shadow import shadow_summary


class PlanSerializer(serializers.ModelSerializer):
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
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_shadow(self, plan: RolloutPlan) -> dict | None:
        return shadow_summary(plan) if plan.mode == PlanMode.SHADOW else None

    def get_arms(self, plan: RolloutPlan) -> list[dict]:
        return [
            {"name": a.name, "version": a.version.version, "weight": a.weight}
            for a in plan.arms.select_related("version")
        ]


class ArmInput(serializers.Serializer):
    name = serializers.CharField(max_length=50)
    version = serializers.IntegerField(min_value=1)
    weight = serializers.FloatField(min_value=0, max_value=100)


class PlanCreateSerializer(serializers.Serializer):
    mode = serializers.ChoiceField(choices=PlanMode.choices)
    candidate = serializers.IntegerField(min_value=1, help_text="version number")
    alias = serializers.CharField(max_length=50, default="production")
    weight = serializers.FloatField(min_value=0, max_value=100, default=0)
    steps = serializers.ListField(
        child=serializers.FloatField(min_value=0, max_value=100), required=False
    )
    max_weight = serializers.FloatField(
        min_value=0,
        max_value=100,
        required=False,
        help_text="highest weight a person may set directly; above it needs an approval",
    )
    bake_seconds = serializers.IntegerField(min_value=0, required=False)
    shadow_sample = serializers.FloatField(min_value=0, max_value=1, required=False)
    routing_header = serializers.CharField(max_length=100, required=False)
    guardrails = serializers.JSONField()
    arms = ArmInput(many=True, required=False)


class WeightSerializer(serializers.Serializer):
    weight = serializers.FloatField(min_value=0, max_value=100)
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class ReasonSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class ApprovalSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    from_version = serializers.IntegerField(
        source="from_version.version", read_only=True, allow_null=True
    )
    to_version = serializers.IntegerField(source="to_version.version", read_only=True)
    requested_by = serializers.CharField(source="requested_label", read_only=True)
    decided_by = serializers.CharField(source="decided_label", read_only=True)
    evidence = serializers.SerializerMethodField()

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
            "requested_by",
            "comment",
            "decided_by",
            "decision_comment",
            "decided_at",
            "created_at",
            "evidence",
        ]
        read_only_fields = fields

    def get_evidence(self, req: ApprovalRequest) -> dict | None:
        # Lists stay cheap: the evidence (several aggregate queries) is on the detail view.
        return evidence_of(req) if self.context.get("with_evidence") else None


class ApprovalFilter(serializers.Serializer):
    state = serializers.ChoiceField(choices=RequestState.choices, required=False)
    kind = serializers.ChoiceField(choices=RequestKind.choices, required=False)
    model = serializers.CharField(required=False)


class PromotionSerializer(serializers.Serializer):
    version = serializers.IntegerField(min_value=1)
    alias = serializers.CharField(max_length=50, default="production")
    comment = serializers.CharField(required=False, allow_blank=True, default="")


class CommentSerializer(serializers.Serializer):
    comment = serializers.CharField(required=False, allow_blank=True, default="")


class ArmMetricsSerializer(serializers.Serializer):
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


class PlanMetricsSerializer(serializers.Serializer):
    plan = serializers.IntegerField()
    arms = ArmMetricsSerializer(many=True)
    diff = serializers.DictField(
        child=serializers.FloatField(), allow_null=True, help_text="candidate minus baseline"
    )
