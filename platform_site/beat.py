"""The beat scheduler: django-celery-beat's DatabaseScheduler, refreshing the heartbeat file
(platform_site.alive) on every tick, so a beat that stops ticking fails its liveness probe."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django_celery_beat.schedulers import DatabaseScheduler

from platform_site.alive import write_alive


class AliveScheduler(DatabaseScheduler):
    def tick(self, *args: Any, **kwargs: Any) -> float:
        # A tick reads the schedule from the database and sends what is due; it returns the
        # seconds until the next (at most the scheduler's max interval, 5 s).
        interval: float = super().tick(*args, **kwargs)
        if settings.SWITCHYARD_ALIVE_FILE:
            write_alive(settings.SWITCHYARD_ALIVE_FILE, True)
        return interval
