"""Celery tasks of tenants: each takes ids (or nothing) and calls one domain function."""

from celery import shared_task

from . import idempotency


@shared_task
def purge_idempotency_records() -> int:
    """Housekeeping: idempotency keys' answers past SWITCHYARD_IDEMPOTENCY_RETENTION_S."""
    return idempotency.purge_expired()
