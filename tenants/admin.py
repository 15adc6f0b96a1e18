"""Admin for tenants, members, quotas, API keys (a new key is shown once, at creation, in the
response page itself: ``shown_once``) and the read-only audit log."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from .audit import user_actor
from .keys import create_api_key, revoke_api_key, set_key_max_in_flight, set_key_priority
from .models import (
    DEFAULT_MAX_IN_FLIGHT,
    ApiKey,
    AuditEvent,
    KeyPriority,
    Membership,
    Quota,
    Tenant,
)
from .shown_once import remember, shown_once_page


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class QuotaInline(admin.StackedInline):
    model = Quota
    can_delete = False


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [QuotaInline, MembershipInline]


class ApiKeyForm(forms.ModelForm):
    # Not required: a key created without saying gets the model's default (interactive).
    priority = forms.TypedChoiceField(
        choices=KeyPriority.choices,
        coerce=int,
        required=False,
        initial=KeyPriority.INTERACTIVE,
        help_text=ApiKey._meta.get_field("priority").help_text,
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
        fields = ["tenant", "name", "priority", "max_in_flight"]

    def clean_priority(self) -> int:
        value = self.cleaned_data.get("priority")
        return int(value) if isinstance(value, int) else KeyPriority.INTERACTIVE

    def clean_max_in_flight(self) -> int:
        value = self.cleaned_data.get("max_in_flight")
        return value if isinstance(value, int) else DEFAULT_MAX_IN_FLIGHT


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    form = ApiKeyForm
    list_display = [
        "name",
        "tenant",
        "prefix",
        "priority",
        "max_in_flight",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["tenant", "priority", ("revoked_at", admin.EmptyFieldListFilter)]
    readonly_fields = ["prefix", "created_by", "created_at", "last_used_at", "revoked_at"]
    fields = ["tenant", "name", "priority", "max_in_flight", *readonly_fields]
    actions = ["revoke"]

    def get_readonly_fields(
        self, request: HttpRequest, obj: ApiKey | None = None
    ) -> list[str] | tuple[str, ...]:
        # The tenant of an existing key never changes: that would move its access.
        return [*self.readonly_fields, "tenant"] if obj else self.readonly_fields

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
        actor = user_actor(request.user)
        key, raw = create_api_key(
            obj.tenant, obj.name, actor, priority=obj.priority, max_in_flight=obj.max_in_flight
        )
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
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role"]
    list_filter = ["tenant", "role"]


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "tenant", "actor_label", "action", "target", "reason"]
    list_filter = ["tenant", "action"]
    search_fields = ["target", "actor_label", "reason"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: AuditEvent | None = None) -> bool:
        return False
