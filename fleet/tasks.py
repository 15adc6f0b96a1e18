"""Celery tasks of the fleet: each takes ids (or nothing) and calls one domain function."""

from celery import shared_task

from .autoscaler import autoscale_all
from .nodes import mark_stale_sessions


@shared_task
def autoscale(deployment_id: int | None = None) -> dict[int, str]:
    """One control-loop pass: every deployment (beat), or one a cold start just woke."""
    return autoscale_all(deployment_id)


@shared_task
def mark_stale_agents_offline() -> int:
    """Close the sessions of agents whose gateway process died without closing them."""
    return mark_stale_sessions()
