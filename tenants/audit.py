"""Who acts, and the append-only audit event every state change writes in its own transaction.

Every app writes here, so this module imports nothing but the audit and tenant models.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import orjson
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db.models import Q, QuerySet

from .models import AuditEvent, Tenant


@dataclass(frozen=True)
class Actor:
    """Who acts: a signed-in user, an API key (acting as the person who created it: their
    ``user_id``, and ``via_key`` its id) or the platform itself (no user)."""

    user_id: int | None
    label: str
    role: str = ""  # the tenant role the actor acts in; approvals need "approver"
    via_key: int | None = None  # the API key the call came through; approvals refuse those


SYSTEM = Actor(None, "system")


def audit(
    tenant_id: int | None,
    actor: Actor,
    action: str,
    target: str,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    reason: str = "",
) -> AuditEvent:
    # The slug is copied so the event still names its tenant once the tenant is deleted.
    slug = (
        Tenant.objects.filter(pk=tenant_id).values_list("slug", flat=True).first()
        if tenant_id is not None
        else None
    )
    return AuditEvent.objects.create(
        tenant_id=tenant_id,
        tenant_slug=slug or "",
        actor_id=actor.user_id,
        actor_label=actor.label,
        action=action,
        target=target,
        before=before or {},
        after=after or {},
        reason=reason,
    )


# Who is deleting, for the tenant-deletion event the ``pre_delete`` signal writes (a signal has
# no request): set around a deletion by whoever knows (the admin); the platform otherwise.
_deleting_as: ContextVar[Actor] = ContextVar("deleting_as", default=SYSTEM)


@contextmanager
def deleting_as(actor: Actor) -> Iterator[None]:
    token = _deleting_as.set(actor)
    try:
        yield
    finally:
        _deleting_as.reset(token)


def audit_tenant_deletion(sender: type[Tenant], instance: Tenant, **kwargs: Any) -> None:
    """``pre_delete`` of a tenant, by any path (the admin, a shell, a command): the deletion is
    itself an event, written in the deletion's transaction, and its history stays."""
    before = {"name": instance.name, "slug": instance.slug}
    audit(instance.pk, _deleting_as.get(), "tenant.delete", f"tenant {instance.slug}", before)


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
    if where.get("until"):
        events = events.filter(created_at__lt=where["until"])
    return events


EXPORT_TYPES = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson"}
EXPORT_FIELDS = (
    "id",
    "created_at",
    "tenant_slug",
    "actor_id",
    "actor_label",
    "action",
    "target",
    "before",
    "after",
    "reason",
)
# A spreadsheet runs a cell that starts with one of these as a formula (CSV injection): the
# export quotes such text with a leading apostrophe, as OWASP advises.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


class _Line:
    """A file-like object whose ``write`` hands back what it was given (csv.writer's output,
    one row at a time, without a buffer of the whole export)."""

    def write(self, text: str) -> str:
        return text


def _cell(value: Any) -> str:
    if isinstance(value, dict | list):
        return orjson.dumps(value).decode()
    text = "" if value is None else str(value)
    return f"'{text}" if text.startswith(_FORMULA_START) else text


def export_lines(events: QuerySet[AuditEvent], fmt: str) -> Iterator[bytes]:
    """The events as CSV (a header row first) or JSON Lines, one row at a time, read from the
    database in chunks so the export of any size holds one chunk in memory."""
    rows = events.values_list(*EXPORT_FIELDS).iterator(chunk_size=1000)
    if fmt == "jsonl":
        for row in rows:
            yield orjson.dumps(dict(zip(EXPORT_FIELDS, row, strict=True))) + b"\n"
        return
    writer = csv.writer(_Line())
    yield writer.writerow(EXPORT_FIELDS).encode()
    for row in rows:
        record = dict(zip(EXPORT_FIELDS, row, strict=True))
        record["created_at"] = record["created_at"].isoformat()
        yield writer.writerow([_cell(record[f]) for f in EXPORT_FIELDS]).encode()
