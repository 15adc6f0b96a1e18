"""Celery tasks of monitoring: each takes ids (or nothing) and calls one domain function."""

import httpx
from celery import Task, shared_task
from django.conf import settings

from . import alerts, drift, prediction_log, slo, usage


@shared_task
def detect_drift() -> dict[str, int]:
    """Drift reports for every version with a reference and traffic in its model's window."""
    return drift.detect_all()


@shared_task
def purge_drift_reports() -> int:
    """Housekeeping: drift reports older than SWITCHYARD_DRIFT_HISTORY_DAYS."""
    return drift.purge_reports()


@shared_task
def evaluate_slos() -> dict[int, dict[str, str | None]]:
    """Raise or resolve every model's SLO burn-rate alerts."""
    return slo.evaluate_slos()


@shared_task
def purge_prediction_logs() -> dict[str, int]:
    """Housekeeping: each model's hour partitions of the log past its retention, and old
    feedback."""
    return prediction_log.purge_expired_logs()


@shared_task
def compact_prediction_logs() -> int:
    """Housekeeping: merge each closed hour's small log files (one per flush of each gateway
    process) into one file."""
    return prediction_log.compact_closed_hours()


@shared_task
def roll_up_usage() -> dict[str, int]:
    """Today's and yesterday's usage from the traffic samples and heartbeats, priced; then
    every budget against this month's spend (alerts, hard stops)."""
    return usage.roll_up()


@shared_task(bind=True, max_retries=5)
def deliver_alert(self: Task, alert_id: int) -> None:
    """Post an alert to its tenant's webhook, retrying with exponential backoff; after the
    last try the alert is marked "failed" (it stays in the UI either way)."""
    try:
        alerts.deliver(alert_id)
    except (httpx.HTTPError, alerts.WebhookFailed) as exc:
        if self.request.retries >= self.max_retries:
            alerts.give_up(alert_id, str(exc) or type(exc).__name__)
            return
        backoff = settings.SWITCHYARD_WEBHOOK_BACKOFF_S * 2**self.request.retries
        raise self.retry(exc=exc, countdown=backoff) from None
