"""Celery tasks of the gateway: thin wrappers over gateway.nodes."""

from celery import shared_task

from .nodes import mark_stale_sessions


@shared_task
def mark_stale_agents_offline() -> int:
    return mark_stale_sessions()
