"""Cold starts: a request for a deployed version with no ready replica wakes its deployment, and
the client is told how the start is going while it waits."""

from __future__ import annotations

import logging
from typing import Any

from django.utils import timezone

from platform_site.jobs import send

from .models import Deployment
from .nodes import live_sessions

log = logging.getLogger(__name__)


def wake(version_id: int) -> bool:
    """A request is waiting for this version and no replica is ready: mark it, so the next
    decision starts one, and run that decision now. False when no deployment serves the
    version (nothing can be started for it)."""
    woken = list(Deployment.objects.filter(version_id=version_id).values_list("pk", flat=True))
    if not woken:
        return False
    Deployment.objects.filter(pk__in=woken).update(woken_at=timezone.now())
    for pk in woken:
        try:
            send("fleet.tasks.autoscale", kwargs={"deployment_id": pk}, expires=60)
        except Exception as exc:  # the broker is down: beat's next tick still sees the wake
            log.warning("could not queue an autoscale run for a cold start: %s", exc)
    return True


COLD_STAGES = [
    ("scaling up", 0.1),
    ("starting a replica", 0.3),
    ("replica connected", 0.5),
    ("loading the model", 0.7),
]


def cold_start_progress(version_id: int) -> dict[str, Any]:
    """Where a cold start of this version stands, for a client told to wait."""
    deployments = Deployment.objects.filter(version_id=version_id)
    replicas = live_sessions().filter(deployment__in=deployments)
    key = str(version_id)
    states = [(s.version_states or {}).get(key, {}).get("state") for s in replicas]
    if "loading" in states:
        stage = 3
    elif replicas:
        stage = 2
    elif deployments.filter(desired_replicas__gt=0).exists():
        stage = 1
    else:
        stage = 0
    name, progress = COLD_STAGES[stage]
    return {"stage": name, "progress": progress}
