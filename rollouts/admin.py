"""Admin for rollout plans and approval requests (read-only: changes go through the API's
actions), and the fleet."""

from datetime import timedelta

from django.conf import settings
from django.contrib import admin
from django.db.models import Count, Q
from django.utils import timezone

from tenants.audit import user_actor

from .deployments import SETTINGS, create_deployment, delete_deployment, update_deployment
from .models import ApprovalRequest, Deployment, PlanArm, Pool, RolloutPlan, ScalingDecision

INLINE_DECISIONS_MIN = 10


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


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = ["name", "backend", "namespace", "description", "deployment_count"]
    search_fields = ["name", "description"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(deployment_count=Count("deployments"))

    @admin.display(description="deployments", ordering="deployment_count")
    def deployment_count(self, pool: Pool) -> int:
        return pool.deployment_count


class DecisionInline(admin.TabularInline):
    """The last minutes only: at one decision per control-loop pass a day holds thousands; the
    scaling decisions' own list has them all."""

    model = ScalingDecision
    extra = 0
    can_delete = False
    max_num = 0
    fields = ["created_at", "current", "desired", "accepted", "dry_run", "reason", "error"]
    readonly_fields = fields
    ordering = ["-created_at"]
    verbose_name_plural = f"scaling decisions of the last {INLINE_DECISIONS_MIN} minutes"

    def get_queryset(self, request):
        since = timezone.now() - timedelta(minutes=INLINE_DECISIONS_MIN)
        return super().get_queryset(request).filter(created_at__gte=since)


# Only the autoscaler writes these; the cluster name follows the version, so changing the
# version (or the pool, or the tenant) of a running deployment would orphan its replicas.
AUTOSCALER_FIELDS = [
    "desired_replicas",
    "cluster_name",
    "woken_at",
    "last_active_at",
    "applied_template",
    "updated_at",
]


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    """Changes go through the same functions as the API (audited, locked, saving only what
    changed); ``desired_replicas`` is read-only: only the autoscaler moves it, after the
    cluster accepted the scale. Live replicas are the agents connected for it now."""

    list_display = [
        "__str__",
        "tenant",
        "pool",
        "min_replicas",
        "max_replicas",
        "desired_replicas",
        "live_replicas",
        "last_active_at",
    ]
    list_filter = ["pool", "tenant", "isolation"]
    list_select_related = ["tenant", "pool", "version__model__tenant"]
    inlines = [DecisionInline]

    def get_queryset(self, request):
        horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD["AGENT_STALE_S"])
        live = Q(sessions__disconnected_at__isnull=True, sessions__last_heartbeat_at__gte=horizon)
        return super().get_queryset(request).annotate(live=Count("sessions", filter=live))

    def get_readonly_fields(self, request, obj=None):
        identity = ["tenant", "version", "pool"] if obj else ["tenant"]  # tenant: the version's
        return [*identity, *AUTOSCALER_FIELDS]

    @admin.display(description="live replicas", ordering="live")
    def live_replicas(self, deployment: Deployment) -> int:
        return deployment.live

    def save_model(self, request, obj, form, change):
        actor = user_actor(request.user)
        if change:
            update_deployment(obj, {f: form.cleaned_data[f] for f in form.changed_data}, actor)
            return
        values = {name: getattr(obj, name) for name in SETTINGS}
        created = create_deployment(obj.version, obj.pool, values, actor)
        obj.pk, obj.tenant_id = created.pk, created.tenant_id

    def has_delete_permission(self, request, obj=None):
        # Its replicas would run on unscaled: the control loop scales only deployments it has
        # rows for. Scale it to zero first (min_replicas 0, then idle).
        return obj is None or (obj.desired_replicas == 0 and not getattr(obj, "live", 0))

    def delete_model(self, request, obj):
        delete_deployment(obj, user_actor(request.user))

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # a bulk delete would skip the check above
        return actions


@admin.register(ScalingDecision)
class ScalingDecisionAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "deployment",
        "current",
        "desired",
        "accepted",
        "dry_run",
        "reason",
        "error",
    ]
    list_filter = ["dry_run", "deployment__pool", "deployment"]
    list_select_related = ["deployment__version__model__tenant", "deployment__pool"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
