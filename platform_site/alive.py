"""Heartbeat files for the Kubernetes probes of the processes that answer no HTTP: the Celery
worker and beat (and, on its own side, the serving agent's ``--alive-file``).

When ``SWITCHYARD_ALIVE_FILE`` is set the process rewrites that file every few seconds from the
loop that does its work, so a wedged process (stuck in a call, a dead event loop) stops
refreshing it: the file's age is the liveness probe. The line inside says whether the process
can do its job now (``ready``, or ``not ready: why``): the readiness probe.
``scripts/probe_alive.py`` checks both, cheaply (no Django, no Celery import; a probe runs every
few seconds). A `celery inspect ping` probe was rejected: it starts Celery and a broker round
trip per probe (seconds of CPU) and answers from a worker whose pool may still be stuck.
"""

from __future__ import annotations

import os
from typing import Any

from celery import bootsteps
from django.conf import settings

ALIVE_EVERY_S = 5.0


def write_alive(path: str, ready: bool, why: str = "") -> None:
    """Replace the heartbeat file in one rename, so a probe never reads half a line."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write("ready\n" if ready else f"not ready: {why}\n")
    os.replace(partial, path)


class AliveStep(bootsteps.StartStopStep):
    """A worker step that refreshes the heartbeat file from the worker's timer. With an event
    loop transport (Redis) the timer runs on the loop that consumes tasks, so a worker whose loop
    is blocked stops beating; ready while its consumer holds a broker connection."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.tref: Any = None

    def include_if(self, parent: Any) -> bool:
        return bool(settings.SWITCHYARD_ALIVE_FILE)

    def start(self, parent: Any) -> None:
        self.beat(parent)
        self.tref = parent.timer.call_repeatedly(ALIVE_EVERY_S, self.beat, (parent,), priority=10)

    def stop(self, parent: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()

    def beat(self, worker: Any) -> None:
        connection = getattr(getattr(worker, "consumer", None), "connection", None)
        connected = connection is not None and bool(connection.connected)
        write_alive(settings.SWITCHYARD_ALIVE_FILE, connected, "no broker connection")
