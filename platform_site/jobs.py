"""Queueing Celery tasks by name, so domain modules never import a ``tasks`` module.

Tasks are the top of each app (they call its domain functions); a domain function that needs
one run later names it, and Celery finds the task in its registry when the message is sent.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from celery import current_app
from django.db import transaction


def send(name: str, *args: Any, **options: Any) -> None:
    """Queue the task ``name`` (e.g. ``"monitoring.tasks.deliver_alert"``) now; ``options`` go to
    ``apply_async`` (``kwargs``, ``countdown``, ``expires``...)."""
    kwargs = options.pop("kwargs", None)
    current_app.signature(name, args=args, kwargs=kwargs).apply_async(**options)


def send_on_commit(name: str, *args: Any, **options: Any) -> None:
    """Queue the task once the current transaction commits (at once outside one), so the
    worker never looks for rows that are not there yet, nor acts on a change rolled back."""
    transaction.on_commit(partial(send, name, *args, **options))
