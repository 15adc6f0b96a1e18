"""Admin for prices: operators set the platform's default prices here (saved through
``usage.set_prices``: validated and audited); a tenant's own prices are shown only, since its
approvers change them through the API under their rules."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest

from platform_site.errors import Invalid
from tenants.audit import user_actor

from . import usage
from .models import Price


class DefaultPriceForm(forms.ModelForm[Price]):
    class Meta:
        model = Price
        fields = ["resource", "unit_price"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        try:
            usage.clean_prices({data.get("resource"): str(data.get("unit_price"))})
        except Invalid as exc:
            raise ValidationError(str(exc)) from None
        return data


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin[Price]):
    """Default prices (no tenant) are edited here; a tenant's own are shown."""

    form = DefaultPriceForm
    list_display = ["resource", "tenant", "unit_price", "currency", "set_by", "set_at"]
    list_filter = ["resource"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Price]:
        return super().get_queryset(request).select_related("tenant", "set_by")

    def has_change_permission(self, request: HttpRequest, obj: Price | None = None) -> bool:
        return super().has_change_permission(request, obj) and (obj is None or not obj.tenant_id)

    def has_delete_permission(self, request: HttpRequest, obj: Price | None = None) -> bool:
        return super().has_delete_permission(request, obj) and (obj is None or not obj.tenant_id)

    def save_model(self, request: HttpRequest, obj: Price, form: Any, change: bool) -> None:
        # Through the domain function: one validated, audited way to set a default.
        usage.set_prices(None, {obj.resource: str(obj.unit_price)}, user_actor(request.user))

    def delete_model(self, request: HttpRequest, obj: Price) -> None:
        usage.set_prices(None, {obj.resource: None}, user_actor(request.user))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Price]) -> None:
        resources = list(queryset.filter(tenant=None).values_list("resource", flat=True))
        usage.set_prices(None, dict.fromkeys(resources), user_actor(request.user))
