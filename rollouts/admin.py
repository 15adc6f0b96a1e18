"""Admin for rollout plans and approval requests: read-only, since changes go through the API's
actions (role, four-eyes rule, row locks, audit)."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from .models import ApprovalRequest, PlanArm, RolloutPlan


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

    def get_readonly_fields(
        self, request: HttpRequest, obj: RolloutPlan | None = None
    ) -> list[str]:
        return [f.name for f in RolloutPlan._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(admin.ModelAdmin):
    """Read-only: decisions go through the approvals inbox or the API, which check the role,
    the four-eyes rule and the row locks."""

    list_display = ["__str__", "kind", "state", "requested_label", "decided_label", "created_at"]
    list_filter = ["state", "kind", "tenant"]
    search_fields = ["model__name", "requested_label", "decided_label", "comment"]

    def get_readonly_fields(
        self, request: HttpRequest, obj: ApprovalRequest | None = None
    ) -> list[str]:
        return [f.name for f in ApprovalRequest._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: ApprovalRequest | None = None
    ) -> bool:
        return False
