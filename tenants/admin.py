"""Admin for tenants, members, quotas, API keys (a new key is shown once, at creation, in the
response page itself: ``shown_once``) and the read-only audit log."""

from __future__ import annotations

from datetime import datetime

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone

from .admin_audit import AuditedAdmin
from .audit import user_actor
from .keys import create_key_like, revoke_api_key, set_key_max_in_flight, set_key_priority
from .models import (
    DEFAULT_MAX_IN_FLIGHT,
    ApiKey,
    AuditEvent,
    KeyPriority,
    Membership,
    Quota,
    Scope,
    Tenant,
)
from .shown_once import remember, shown_once_page


class MembershipInline(admin.TabularInline[Membership, Tenant]):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class QuotaInline(admin.StackedInline[Quota, Tenant]):
    model = Quota
    can_delete = False


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin[Tenant]):
    """Saves, deletes and the quota and membership inlines are audited (``AuditedAdmin``); a
    deleted tenant's audit history stays, with its slug."""

    list_display = ["slug", "name", "created_at"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [QuotaInline, MembershipInline]


class ApiKeyForm(forms.ModelForm[ApiKey]):
    # Not required: a key created without saying gets the model's default (interactive).
    priority = forms.TypedChoiceField(
        choices=KeyPriority.choices,
        coerce=int,
        required=False,
        initial=KeyPriority.INTERACTIVE,
        help_text=ApiKey._meta.get_field("priority").help_text,
    )

    scopes = forms.MultipleChoiceField(
        choices=Scope.choices,
        widget=forms.CheckboxSelectMultiple,
        initial=[Scope.PREDICT],
        required=False,  # none ticked: predict, the default
        help_text="Fixed once the key exists: rotate it for other scopes.",
    )

    # Not required either: left empty, the model's default.
    max_in_flight = forms.IntegerField(
        min_value=1,
        max_value=100_000,
        required=False,
        initial=DEFAULT_MAX_IN_FLIGHT,
        help_text=ApiKey._meta.get_field("max_in_flight").help_text,
    )

    class Meta:
        model = ApiKey
        fields = ["tenant", "name", "scopes", "expires_at", "priority", "max_in_flight"]

    def clean_priority(self) -> int:
        value = self.cleaned_data.get("priority")
        return int(value) if isinstance(value, int) else KeyPriority.INTERACTIVE

    def clean_scopes(self) -> list[str]:
        return list(self.cleaned_data.get("scopes") or [Scope.PREDICT])

    def clean_expires_at(self) -> datetime | None:
        value = self.cleaned_data.get("expires_at")
        if value is not None and value <= timezone.now():
            raise forms.ValidationError("must be in the future")
        return value

    def clean_max_in_flight(self) -> int:
        value = self.cleaned_data.get("max_in_flight")
        return value if isinstance(value, int) else DEFAULT_MAX_IN_FLIGHT


@admin.register(ApiKey)
class ApiKeyAdmin(AuditedAdmin[ApiKey]):
    form = ApiKeyForm
    list_display = [
        "name",
        "tenant",
        "prefix",
        "scopes",
        "expires_at",
        "priority",
        "max_in_flight",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["tenant", "priority", ("revoked_at", admin.EmptyFieldListFilter)]
    readonly_fields = ["prefix", "created_by", "created_at", "last_used_at", "revoked_at"]
    fields = ["tenant", "name", "scopes", "expires_at", "priority", "max_in_flight"]
    fields += readonly_fields
    actions = ["revoke"]

    def get_readonly_fields(
        self, request: HttpRequest, obj: ApiKey | None = None
    ) -> list[str] | tuple[str, ...]:
        # The tenant of an existing key never changes (that would move its access), nor its
        # scopes or expiry (a rotation replaces the key).
        fixed = ["tenant", "scopes", "expires_at"]
        return [*self.readonly_fields, *fixed] if obj else self.readonly_fields

    def save_model(
        self, request: HttpRequest, obj: ApiKey, form: forms.ModelForm[ApiKey], change: bool
    ) -> None:
        if change:
            if "priority" in form.changed_data:  # audited, under a row lock
                set_key_priority(obj, obj.priority, user_actor(request.user))
            if "max_in_flight" in form.changed_data:
                set_key_max_in_flight(obj, obj.max_in_flight, user_actor(request.user))
            super().save_model(request, obj, form, change)
            return
        key, raw = create_key_like(obj, user_actor(request.user), obj.expires_at)
        obj.pk = key.pk
        obj.prefix = key.prefix
        remember(request, f"API key {key.name!r} of {obj.tenant}", raw)

    def response_add(
        self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None
    ) -> HttpResponse:
        # The key is shown in this response, never through the messages cookie of a redirect.
        page = shown_once_page(
            request, "API key created", "the key", reverse("admin:tenants_apikey_changelist")
        )
        return page or super().response_add(request, obj, post_url_continue)

    @admin.action(description="Revoke selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        for key in queryset:
            revoke_api_key(key, user_actor(request.user))
        messages.success(request, f"Revoked {queryset.count()} key(s).")


@admin.register(Membership)
class MembershipAdmin(AuditedAdmin[Membership]):
    list_display = ["user", "tenant", "role"]
    list_filter = ["tenant", "role"]


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin[AuditEvent]):
    # The slug, not the tenant: an event outlives its tenant (no row to follow there).
    list_display = ["created_at", "tenant_slug", "actor_label", "action", "target", "reason"]
    list_filter = ["tenant_slug", "action"]
    search_fields = ["target", "actor_label", "reason"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return False
