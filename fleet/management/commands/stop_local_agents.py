"""Stop the agent replicas the local backend started (``make up`` runs this on exit)."""

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from fleet.cluster.local import LocalBackend


class Command(BaseCommand):
    help = "Stop every local agent replica, keeping their specs: the autoscaler restarts them."

    def handle(self, **options: Any) -> None:
        # No pool token is needed to stop processes; the path is never read here.
        backend = LocalBackend(
            settings.SWITCHYARD_LOCAL_AGENTS_DIR,
            settings.SWITCHYARD_PLATFORM_URL,
            settings.SWITCHYARD_VAR_DIR,
        )
        for name in backend.stop_all():
            self.stdout.write(f"stopped the replicas of {name}")
