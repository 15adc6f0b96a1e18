"""Alerts: drift past its threshold, SLO burn and rollbacks, shown in the UI until resolved and
posted to the tenant's webhook as Slack-compatible JSON, with retries (``deliver``).

One condition has one open alert (its ``key``): raising it again only refreshes
``last_seen_at``, so a drift job running every minute does not post every minute.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone

from platform_site.errors import Conflict, NotFound
from platform_site.jobs import send_on_commit
from tenants.audit import Actor, audit
from tenants.models import Tenant

from .models import Alert

log = logging.getLogger(__name__)

WEBHOOK_TIMEOUT_S = 5.0


class WebhookFailed(Exception):
    """The webhook answered with an error status (retried) — the message says which."""


def raise_alert(
    tenant_id: int,
    kind: str,
    key: str,
    title: str,
    message: str,
    *,
    model_id: int | None = None,
    severity: str = "warning",
    details: dict[str, Any] | None = None,
) -> tuple[Alert, bool]:
    """Open an alert for this condition, or refresh the open one; returns (alert, new)."""
    now = timezone.now()
    open_alert = Alert.objects.filter(tenant_id=tenant_id, key=key, resolved_at=None).first()
    if open_alert is not None:
        open_alert.last_seen_at = now
        open_alert.message = message
        open_alert.details = details or {}
        open_alert.save(update_fields=["last_seen_at", "message", "details"])
        return open_alert, False
    webhook = Tenant.objects.filter(pk=tenant_id).values_list("alert_webhook_url", flat=True)
    try:
        with transaction.atomic():
            alert = Alert.objects.create(
                tenant_id=tenant_id,
                model_id=model_id,
                kind=kind,
                severity=severity,
                key=key,
                title=title,
                message=message,
                details=details or {},
                created_at=now,
                last_seen_at=now,
                webhook_state="pending" if webhook.first() else "none",
            )
    except IntegrityError:  # another worker opened it first
        return Alert.objects.get(tenant_id=tenant_id, key=key, resolved_at=None), False
    if alert.webhook_state == "pending":
        send_on_commit("monitoring.tasks.deliver_alert", alert.pk)
    return alert, True


def resolve_alert(tenant_id: int, key: str) -> int:
    """Close the open alert of a condition that no longer holds; returns how many closed."""
    return Alert.objects.filter(tenant_id=tenant_id, key=key, resolved_at=None).update(
        resolved_at=timezone.now()
    )


def alerts_of(tenant_id: int) -> QuerySet[Alert]:
    """Every alert lookup goes through the tenant: another tenant's alert is never found."""
    return Alert.objects.filter(tenant_id=tenant_id).select_related("model")


def alert_for(tenant_id: int, alert_id: int) -> Alert:
    found = alerts_of(tenant_id).filter(pk=alert_id).first()
    if found is None:
        raise NotFound(f"no alert {alert_id}")
    return found


def open_alerts(tenant_id: int) -> QuerySet[Alert]:
    return alerts_of(tenant_id).filter(resolved_at=None)


def resolve_by_hand(alert: Alert, actor: Actor, reason: str) -> Alert:
    """Close an open alert for a person, audited; 409 when it is already resolved."""
    with transaction.atomic():
        # A conditional update: the drift or SLO job may resolve it at the same moment, and
        # exactly one of the two closes it (and only a person's close is audited).
        closed = Alert.objects.filter(pk=alert.pk, resolved_at=None).update(
            resolved_at=timezone.now()
        )
        if not closed:
            raise Conflict(f"alert #{alert.pk} is already resolved")
        audit(
            alert.tenant_id,
            actor,
            "alert.resolve",
            f"alert #{alert.pk} {alert.key}",
            {"state": "open"},
            {"state": "resolved"},
            reason,
        )
    alert.refresh_from_db()
    return alert


def redacted(url: str) -> str:
    """A webhook URL for the audit trail: Slack's carry their secret in the path."""
    if not url:
        return ""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/…"


def set_webhook_url(tenant_id: int, url: str, actor: Actor) -> Tenant:
    """Where the tenant's alerts are posted ("" for nowhere), audited without the secret."""
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().get(pk=tenant_id)
        before = tenant.alert_webhook_url
        tenant.alert_webhook_url = url
        tenant.save(update_fields=["alert_webhook_url"])
        audit(
            tenant_id,
            actor,
            "alert.webhook",
            tenant.slug,
            {"webhook_url": redacted(before)},
            {"webhook_url": redacted(url)},
        )
    return tenant


def slack_payload(alert: Alert) -> dict[str, Any]:
    """Slack's incoming-webhook shape: ``text`` for notifications, a block for the body."""
    icon = ":rotating_light:" if alert.severity == "critical" else ":warning:"
    text = f"{icon} [{alert.tenant.slug}] {alert.title}"
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{text}*\n{alert.message}"}}
        ],
    }


def deliver(alert_id: int) -> None:
    """POST the alert to its tenant's webhook once; raises on failure so the task retries."""
    alert = Alert.objects.select_related("tenant").get(pk=alert_id)
    url = alert.tenant.alert_webhook_url
    if not url or alert.webhook_state == "sent":
        return
    alert.webhook_attempts += 1
    blocked = private_destination(url)
    if blocked:  # a tenant must not make the platform call its own network; never retried
        give_up(alert_id, blocked)
        return
    try:
        response = httpx.post(url, json=slack_payload(alert), timeout=WEBHOOK_TIMEOUT_S)
        if response.status_code >= 300:
            raise WebhookFailed(f"webhook answered {response.status_code}")
    except (httpx.HTTPError, WebhookFailed) as exc:
        alert.webhook_error = str(exc)[:300] or type(exc).__name__
        alert.save(update_fields=["webhook_attempts", "webhook_error"])
        raise
    alert.webhook_state = "sent"
    alert.webhook_error = ""
    alert.save(update_fields=["webhook_state", "webhook_attempts", "webhook_error"])


def private_destination(url: str) -> str | None:
    """Why the webhook must not be called when its host resolves to a loopback, private,
    link-local or reserved address (the platform's own network), else None. Allowed with
    ``SWITCHYARD_WEBHOOK_ALLOW_PRIVATE`` (a webhook inside the cluster, the tests)."""
    if settings.SWITCHYARD_WEBHOOK_ALLOW_PRIVATE:
        return None
    host = urlsplit(url).hostname or ""
    try:
        # An IPv4 or IPv6 entry's address is a string (the stubs allow other families' ints).
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError as exc:
        return f"webhook host {host!r} does not resolve: {exc}"
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved:
            return f"webhook host {host!r} is on a private network ({ip}); not called"
    return None


def give_up(alert_id: int, error: str) -> None:
    """Retries exhausted: the alert stays visible in the UI, marked as not delivered."""
    Alert.objects.filter(pk=alert_id).update(webhook_state="failed", webhook_error=error[:300])
