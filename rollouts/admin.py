"""Admin for rollout plans (read-mostly: changes go through the API's actions) and the audit log."""

from django.contrib import admin

from .models import (
    ApprovalRequest,
    AuditEvent,
    Deployment,
    PlanArm,
    Pool,
    RolloutPlan,
    ScalingDecision,
)


class PlanArmInline(admin.TabularInline):
    model = PlanArm
    extra = 0
    can_delete = False
    readonly_fields = ["name", "version", "weight"]


@admin.register(RolloutPlan)
class RolloutPlanAdmin(admin.ModelAdmin):
    list_display = ["__str__", "mode", "state", "weight", "updated_at"]
    list_filter = ["mode", "state", "model__tenant"]
    inlines = [PlanArmInline]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in RolloutPlan._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(admin.ModelAdmin):
    """Read-only: decisions go through the approvals inbox or the API, which check the role,
    the four-eyes rule and the row locks."""

    list_display = ["__str__", "kind", "state", "requested_label", "decided_label", "created_at"]
    list_filter = ["state", "kind", "tenant"]
    search_fields = ["model__name", "requested_label", "decided_label", "comment"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in ApprovalRequest._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "tenant", "actor_label", "action", "target", "reason"]
    list_filter = ["tenant", "action"]
    search_fields = ["target", "actor_label", "reason"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ["name", "backend", "namespace", "description"]


class DecisionInline(admin.TabularInline):
    model = ScalingDecision
    extra = 0
    can_delete = False
    max_num = 0
    fields = ["created_at", "current", "desired", "accepted", "dry_run", "reason", "error"]
    readonly_fields = fields
    ordering = ["-created_at"]


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    """``desired_replicas`` is read-only: only the autoscaler moves it, after the cluster
    accepted the scale."""

    list_display = ["__str__", "tenant", "min_replicas", "max_replicas", "desired_replicas"]
    list_filter = ["pool", "tenant", "isolation"]
    readonly_fields = ["desired_replicas", "updated_at"]
    inlines = [DecisionInline]


@admin.register(ScalingDecision)
class ScalingDecisionAdmin(admin.ModelAdmin):
    list_display = ["created_at", "deployment", "current", "desired", "accepted", "reason"]
    list_filter = ["dry_run", "deployment__pool"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
