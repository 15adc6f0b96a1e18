"""Alerts: drift past its threshold, SLO burn and rollbacks, shown in the UI until resolved and
posted to the tenant's webhook as Slack-compatible JSON, with retries (``deliver``).

One condition has one open alert (its ``key``): raising it again only refreshes
``last_seen_at``, so a drift job running every minute does not post every minute.
"""

from __future__ import annotations

import logging

import httpx
from django.db import IntegrityError, transaction
from django.utils import timezone

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
    details: dict | None = None,
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
    from tenants.models import Tenant

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
        from .tasks import deliver_alert

        transaction.on_commit(lambda: deliver_alert.delay(alert.pk))
    return alert, True


def resolve_alert(tenant_id: int, key: str) -> int:
    """Close the open alert of a condition that no longer holds; returns how many closed."""
    return Alert.objects.filter(tenant_id=tenant_id, key=key, resolved_at=None).update(
        resolved_at=timezone.now()
    )


def open_alerts(tenant_id: int):
    return Alert.objects.filter(tenant_id=tenant_id, resolved_at=None).select_related("model")


def slack_payload(alert: Alert) -> dict:
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


def give_up(alert_id: int, error: str) -> None:
    """Retries exhausted: the alert stays visible in the UI, marked as not delivered."""
    Alert.objects.filter(pk=alert_id).update(webhook_state="failed", webhook_error=error[:300])
