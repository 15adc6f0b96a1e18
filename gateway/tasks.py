"""Celery tasks of the gateway: thin wrappers over gateway.nodes and gateway.predlog."""

from celery import shared_task

from .nodes import mark_stale_sessions
from .predlog import purge_expired_logs


@shared_task
def mark_stale_agents_offline() -> int:
    return mark_stale_sessions()


@shared_task
def purge_prediction_logs() -> dict[str, int]:
    return purge_expired_logs()
