"""Admin for rollout plans, approval requests and policies: read-only, since changes go through
the API's actions (role, four-eyes rule, row locks, audit). Aliases are editable, but a move
goes through ``approvals.move_alias`` as the admin user: audited, and a protected alias opens
a promotion request instead of moving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import Model
from django.http import HttpRequest

from platform_site.errors import Conflict, Forbidden
from registry.models import Alias
from tenants.audit import Actor, user_actor
from tenants.models import Membership

from .approvals import move_alias
from .models import (
    ApprovalRequest,
    ApprovalVote,
    FreezeOverride,
    PlanArm,
    RolloutPlan,
    RolloutPolicy,
)

# Any model: the audited/read-only bases are generic over the admin's model.
_M = TypeVar("_M", bound=Model)


if TYPE_CHECKING:
    from django.utils.functional import _StrOrPromise as StrOrPromise


class ReadOnlyAdmin(admin.ModelAdmin[_M]):
    """Shown, never changed here: the API and the web UI change these under their rules."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # view only: no save button, no form to post


@admin.register(RolloutPolicy)
class RolloutPolicyAdmin(ReadOnlyAdmin[RolloutPolicy]):
    """Set by an approver through the API (``PUT /api/v1/policy``), audited there."""

    list_display = ["__str__", "tenant", "approvals_needed", "updated_by", "updated_at"]
    list_filter = ["tenant"]


@admin.register(FreezeOverride)
class FreezeOverrideAdmin(ReadOnlyAdmin[FreezeOverride]):
    list_display = ["__str__", "created_label", "reason", "created_at"]


def admin_actor(request: HttpRequest, tenant_id: int) -> Actor:
    """The admin user, acting in the role they hold in the tenant (none for a superuser who
    is no member: they can ask for a promotion but never approve one)."""
    role = (
        Membership.objects.filter(user_id=request.user.pk or 0, tenant_id=tenant_id)
        .values_list("role", flat=True)
        .first()
    )
    return user_actor(request.user, role or "")


@admin.register(Alias)
class AliasAdmin(admin.ModelAdmin[Alias]):
    list_display = ["__str__", "model", "name", "version", "updated_at", "updated_by"]
    list_filter = ["model__tenant"]
    readonly_fields = ["updated_by", "updated_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Alias | None = None) -> list[str]:
        # An alias changes only its version here: another model or name is another alias.
        return [*self.readonly_fields, "model", "name"] if obj else list(self.readonly_fields)

    def has_delete_permission(self, request: HttpRequest, obj: Alias | None = None) -> bool:
        return False  # deleting production would take a model out of service unreviewed

    def save_model(
        self, request: HttpRequest, obj: Alias, form: forms.ModelForm[Alias], change: bool
    ) -> None:
        model, version = obj.model, obj.version
        actor = admin_actor(request, model.tenant_id)
        try:
            moved = move_alias(model, obj.name, version, actor, "changed in the Django admin")
        except (Conflict, Forbidden, ValidationError) as error:
            text = "; ".join(error.messages) if isinstance(error, ValidationError) else str(error)
            note = (messages.ERROR, f"{obj.name!r} not moved: {text}")
            request._governed_message = note  # type: ignore[attr-defined]
            return
        if isinstance(moved, ApprovalRequest):
            request._governed_message = (  # type: ignore[attr-defined]
                messages.WARNING,
                f"{model.name}@{obj.name} is protected: promotion request #{moved.pk} to "
                f"v{version.version} is open; it moves once an approver approves it.",
            )
            return
        obj.pk = moved.pk

    def message_user(
        self,
        request: HttpRequest,
        message: StrOrPromise,
        level: int | str = messages.INFO,
        extra_tags: str = "",
        fail_silently: bool = False,
    ) -> None:
        # The admin's "changed successfully" would be untrue when the move became a request.
        level, message = getattr(request, "_governed_message", (level, message))
        super().message_user(request, message, level, extra_tags, fail_silently)


class ApprovalVoteInline(admin.TabularInline[ApprovalVote, ApprovalRequest]):
    model = ApprovalVote
    extra = 0
    can_delete = False
    readonly_fields = ["user", "label", "approved", "comment", "at"]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class PlanArmInline(admin.TabularInline[PlanArm, RolloutPlan]):
    model = PlanArm
    extra = 0
    can_delete = False
    readonly_fields = ["name", "version", "weight"]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # an arm added here would carry traffic no policy looked at

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(RolloutPlan)
class RolloutPlanAdmin(ReadOnlyAdmin[RolloutPlan]):
    """View only: weights and arms change through the API (``approvals.change_weight`` and
    ``change_arms``), under the rollout policy."""

    list_display = ["__str__", "mode", "state", "weight", "updated_at"]
    list_filter = ["mode", "state", "model__tenant"]
    inlines = [PlanArmInline]


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(admin.ModelAdmin[ApprovalRequest]):
    """Read-only: decisions go through the approvals inbox or the API, which check the role,
    the four-eyes rule and the row locks."""

    list_display = ["__str__", "kind", "state", "requested_label", "decided_label", "created_at"]
    list_filter = ["state", "kind", "tenant"]
    inlines = [ApprovalVoteInline]
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
