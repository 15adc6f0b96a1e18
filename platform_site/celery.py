"""The Celery app, wired as in django-celery-beat's example project."""

import os

from celery import Celery

from platform_site import telemetry
from platform_site.alive import AliveStep

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")

app = Celery("switchyard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# The heartbeat file of the worker's Kubernetes probes (only when SWITCHYARD_ALIVE_FILE is set).
app.steps["worker"].add(AliveStep)
# A span per task, under the context of whoever queued it (off unless OTEL_TRACES_EXPORTER is
# set: docs/observability.md, "Traces").
telemetry.trace_celery()
