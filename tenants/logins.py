"""Sign-in lockouts (django-axes throttles the web UI's and the admin's sign-in), audited.

A lockout changes who may sign in, so it is a state change: it writes an audit event in every
tenant the person belongs to, once per lockout (django-axes signals again on every attempt made
while locked out, which must not let a stranger flood a tenant's audit log). A username that
names nobody in a tenant has no tenant's log to go to; it is logged as a warning instead.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from .audit import SYSTEM, audit
from .models import AuditEvent, Membership

log = logging.getLogger(__name__)


def audit_lockout(username: str, ip_address: str | None) -> int:
    """Write the lockout of ``username`` from ``ip_address`` to each of their tenants' audit
    logs; returns how many events it wrote."""
    user = get_user_model().objects.filter(username=username).first()
    tenant_ids = (
        list(Membership.objects.filter(user=user).values_list("tenant_id", flat=True))
        if user is not None
        else []
    )
    if not tenant_ids:
        log.warning(
            "sign-in locked out for %r from %s (no tenant to audit it in)", username, ip_address
        )
        return 0
    target = f"user:{username}"
    with transaction.atomic():
        already = set(
            AuditEvent.objects.filter(
                action="login.lockout",
                target=target,
                created_at__gte=timezone.now() - settings.AXES_COOLOFF_TIME,
            ).values_list("tenant_id", flat=True)
        )
        tenant_ids = [t for t in tenant_ids if t not in already]
        for tenant_id in tenant_ids:
            audit(
                tenant_id,
                SYSTEM,
                "login.lockout",
                target,
                after={"ip_address": ip_address},
                reason="too many failed sign-ins",
            )
    return len(tenant_ids)


def on_user_locked_out(
    sender: Any, request: Any, username: str | None, ip_address: str | None, **kwargs: Any
) -> None:
    """django-axes' ``user_locked_out`` signal."""
    audit_lockout(username or "", ip_address)
