"""Celery tasks of rollouts: each calls one domain function (the guardrails)."""

import logging

from celery import shared_task

from platform_site.errors import Conflict

from .guardrails import evaluate
from .models import PlanMode, PlanState, RolloutPlan

log = logging.getLogger(__name__)


@shared_task
def evaluate_rollouts() -> dict[int, str]:
    """Judge every running canary and A/B plan once; returns plan id -> action taken."""
    done = {}
    judged = (PlanMode.CANARY, PlanMode.AB)
    for plan in RolloutPlan.objects.filter(state=PlanState.RUNNING, mode__in=judged):
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
