"""Tenant-scoped lookups of models and versions. Every lookup by a name or number that a caller
sent goes through here, so another tenant's model is never found: it is the same 404 as a model
that does not exist."""

from __future__ import annotations

from django.db.models import QuerySet

from platform_site.errors import NotFound

from .models import ALIAS_NAME, MODEL_NAME, Alias, Model, ModelVersion


def models_of(tenant_id: int) -> QuerySet[Model]:
    return Model.objects.filter(tenant_id=tenant_id)


def aliases_of(tenant_id: int) -> QuerySet[Alias]:
    return Alias.objects.filter(model__tenant_id=tenant_id)


def model_for(tenant_id: int, name: str) -> Model:
    # A name no model can have is not looked up: some (a NUL byte) PostgreSQL cannot even
    # compare, and its error would read as the database failing.
    if MODEL_NAME.fullmatch(name) is None:
        raise NotFound(f"model {name[:120]!r} not found")
    found = models_of(tenant_id).filter(name=name).first()
    if found is None:
        raise NotFound(f"model {name!r} not found")
    return found


def version_for(model: Model, number: int) -> ModelVersion:
    """One version of a model that was itself looked up through its tenant."""
    found = model.versions.select_related("model").filter(version=number).first()
    if found is None:
        raise NotFound(f"model {model.name!r} has no version {number}")
    return found


def alias_for(model: Model, name: str) -> Alias:
    """One alias of a model that was itself looked up through its tenant. A name no alias can
    have is not looked up (PostgreSQL cannot compare some, such as a NUL byte)."""
    found = None
    if ALIAS_NAME.fullmatch(name) is not None:
        found = model.aliases.select_related("version", "updated_by").filter(name=name).first()
    if found is None:
        raise NotFound(f"model {model.name!r} has no alias {name[:60]!r}")
    return found
