"""A ModelAdmin mixin that audits every save and delete made in the Django admin, in the same
transaction (the admin's change and delete views run in one): who, what, before and after."""

from __future__ import annotations

from typing import Any, TypeVar

from django.contrib import admin
from django.db import models, transaction
from django.db.models import Model, QuerySet
from django.http import HttpRequest

from .audit import audit, deleting_as, user_actor
from .models import Tenant

# Fields never copied into the audit log: secrets (even hashed) and file contents.
HIDDEN = ("hash", "token", "password", "secret", "artifact")


# Any model: the audited/read-only bases are generic over the admin's model.
_M = TypeVar("_M", bound=Model)


def tenant_of(obj: models.Model) -> int | None:
    """The tenant an object belongs to (None: platform-wide): itself, its ``tenant``, or the
    tenant of its ``model`` (versions, aliases) or ``version``."""
    if isinstance(obj, Tenant):
        return obj.pk
    for path in ("tenant_id", "model.tenant_id", "version.model.tenant_id"):
        value: Any = obj
        for part in path.split("."):
            value = getattr(value, part, None)
            if value is None:
                break
        if value is not None:
            return int(value)
    return None


def snapshot(obj: models.Model) -> dict[str, Any]:
    """The object's own fields as JSON-safe values, secrets left out."""
    out: dict[str, Any] = {}
    for field in obj._meta.concrete_fields:
        if any(word in field.name for word in HIDDEN):
            continue
        value = field.value_from_object(obj)
        out[field.attname] = (
            value
            if value is None or isinstance(value, str | int | float | bool | list | dict)
            else str(value)
        )
    return out


def changed(before: dict[str, Any], after: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = [k for k in after if before.get(k) != after[k]]
    return {k: before.get(k) for k in keys}, {k: after[k] for k in keys}


def audit_admin(
    request: HttpRequest,
    obj: models.Model,
    verb: str,
    before: dict[str, Any],
    after: dict[str, Any],
) -> None:
    label = obj._meta.label_lower.split(".")[1]
    audit(
        tenant_of(obj),
        user_actor(request.user),
        f"{label}.{verb}",
        f"{obj._meta.verbose_name} {obj}",
        before,
        after,
        reason="Django admin",
    )


class AuditedAdmin(admin.ModelAdmin[_M]):
    """Audits the admin's own saves and deletes (of the object and of its inlines). An admin
    whose ``save_model`` already calls an audited domain function sets ``audits_saves``
    False and keeps the deletes audited."""

    audits_saves = True

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if not self.audits_saves:
            super().save_model(request, obj, form, change)
            return
        with transaction.atomic():
            before = snapshot(type(obj).objects.get(pk=obj.pk)) if change and obj.pk else {}
            super().save_model(request, obj, form, change)
            old, new = changed(before, snapshot(obj))
            if new or not change:
                audit_admin(request, obj, "update" if change else "create", old, new)

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        with transaction.atomic(), deleting_as(user_actor(request.user)):
            if not isinstance(obj, Tenant):  # a tenant's deletion is audited by its signal
                audit_admin(request, obj, "delete", snapshot(obj), {})
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        with transaction.atomic(), deleting_as(user_actor(request.user)):
            for obj in queryset:
                if not isinstance(obj, Tenant):
                    audit_admin(request, obj, "delete", snapshot(obj), {})
            super().delete_queryset(request, queryset)

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        """Inline rows (a tenant's quota and memberships): each created, changed or deleted
        row audited as its own event."""
        befores = {
            f.instance.pk: snapshot(type(f.instance).objects.get(pk=f.instance.pk))
            for f in formset.forms
            if f.instance.pk and f.has_changed()
        }
        with transaction.atomic():
            super().save_formset(request, form, formset, change)
            for obj in formset.deleted_objects:
                audit_admin(request, obj, "delete", snapshot(obj), {})
            for obj in formset.new_objects:
                audit_admin(request, obj, "create", {}, snapshot(obj))
            for obj, _fields in formset.changed_objects:
                old, new = changed(befores.get(obj.pk, {}), snapshot(obj))
                audit_admin(request, obj, "update", old, new)
