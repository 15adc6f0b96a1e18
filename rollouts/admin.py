"""Admin for rollout plans (read-mostly: changes go through the API's actions) and the audit log."""

from django.contrib import admin

from .models import AuditEvent, PlanArm, RolloutPlan


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
