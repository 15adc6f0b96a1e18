"""Who acts, and the append-only audit event every state change writes in its own transaction.

Registry (alias moves) and tenants (API keys) write here too, so this module imports nothing
but the audit model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db.models import Q, QuerySet

from .models import AuditEvent


@dataclass(frozen=True)
class Actor:
    """Who acts: a signed-in user, an API key (no user) or the platform itself (no user)."""

    user_id: int | None
    label: str
    role: str = ""  # the tenant role the actor acts in; approvals need "approver"


SYSTEM = Actor(None, "system")


def audit(
    tenant_id: int,
    actor: Actor,
    action: str,
    target: str,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    reason: str = "",
) -> AuditEvent:
    return AuditEvent.objects.create(
        tenant_id=tenant_id,
        actor_id=actor.user_id,
        actor_label=actor.label,
        action=action,
        target=target,
        before=before or {},
        after=after or {},
        reason=reason,
    )


def user_actor(user: AbstractBaseUser | AnonymousUser, role: str = "") -> Actor:
    """A signed-in person acting (the admin, the web UI, the API with a session)."""
    return Actor(user.pk, user.get_username(), role)


def audit_events(tenant_id: int, where: dict[str, Any]) -> QuerySet[AuditEvent]:
    """The tenant's audit events, newest first, filtered as the API and the UI allow."""
    events = AuditEvent.objects.filter(tenant_id=tenant_id)
    if where.get("action"):
        events = events.filter(action=where["action"])
    if where.get("actor"):
        events = events.filter(actor_label__icontains=where["actor"])
    if where.get("q"):
        events = events.filter(Q(target__icontains=where["q"]) | Q(reason__icontains=where["q"]))
    if where.get("since"):
        events = events.filter(created_at__gte=where["since"])
    return events
