"""Celery tasks of rollouts: thin wrappers over rollouts.guardrails."""

import logging

import httpx
from celery import shared_task
from django.conf import settings

from platform_site.errors import Conflict

from . import alerts
from .fleet import autoscale_all
from .guardrails import evaluate
from .models import PlanMode, PlanState, RolloutPlan

log = logging.getLogger(__name__)


@shared_task
def evaluate_rollouts() -> dict[int, str]:
    """Judge every running canary plan once; returns plan id -> action taken."""
    done = {}
    for plan in RolloutPlan.objects.filter(state=PlanState.RUNNING, mode=PlanMode.CANARY):
        try:
            verdict = evaluate(plan)
        except Conflict as lost:
            # A person acted on the plan first (kill, pause, approval): theirs stands.
            log.info("plan %s: %s", plan.pk, lost)
            continue
        done[plan.pk] = verdict.action
        if verdict.action not in ("wait", "hold"):
            log.info("plan %s: %s (%s)", plan.pk, verdict.action, verdict.reason)
    return done


@shared_task
def autoscale(deployment_id: int | None = None) -> dict[int, str]:
    """One control-loop pass: every deployment (beat), or one a cold start just woke."""
    return autoscale_all(deployment_id)


@shared_task(bind=True, max_retries=5)
def deliver_alert(self, alert_id: int) -> None:
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


@shared_task
def evaluate_slos() -> dict[int, dict[str, str | None]]:
    """Raise or resolve every model's SLO burn-rate alerts (rollouts.slo)."""
    from .slo import evaluate_slos as evaluate_all

    return evaluate_all()


@shared_task
def detect_drift() -> dict[str, int]:
    """Drift reports for every version with a reference and traffic in its model's window."""
    from .drift import detect_all  # imported here: this file's imports sit above other tasks

    return detect_all()


@shared_task
def purge_drift_reports() -> int:
    """Housekeeping: drift reports older than SWITCHYARD_DRIFT_HISTORY_DAYS."""
    from .drift import purge_reports

    return purge_reports()
