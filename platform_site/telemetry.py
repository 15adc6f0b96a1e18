"""The platform's OpenTelemetry spans: each process's pipeline (the gateway's, the Celery
worker's), configured from OpenTelemetry's standard environment variables, and the spans of
Celery tasks. Off by default: no pipeline, nothing recorded (docs/observability.md, "Traces").

The settings are read by ``serving_agent.telemetry``, which the agent uses too (it is below
every app in the dependency rule), so a variable means the same on both sides of a request.
The gateway's spans are made by ``gateway.spans`` after each sampled request's reply; a Celery
task's span is live while it runs, and the context of whoever queued it travels in the task's
headers (W3C ``traceparent``), so a task queued by a traced task is its child.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from serving_agent import telemetry as shared
from serving_agent.__version__ import __version__

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

# The process's pipeline and its sampling; both None when tracing is off. ``sampling`` is read
# by every request's ``gateway.tracing.start_trace``: off, that read is all tracing costs.
exporting: shared.Exporting | None = None
sampling: shared.Sampling | None = None
_tracer: Tracer | None = None  # Celery's spans, live while a task runs


def configure(
    service_name: str = "switchyard",
    env: Mapping[str, str] = os.environ,
    exporter: SpanExporter | None = None,
) -> shared.Exporting | None:
    """Set up (or replace) this process's pipeline as the environment says; ``exporter``
    replaces the OTLP one (tests). Returns it, or None when tracing is off."""
    global exporting, sampling, _tracer
    shutdown()
    if exporter is None:
        made = shared.from_env(service_name, env)
    else:
        made = shared.Exporting(service_name, shared.sampling_from_env(env), exporter, env)
    if made is None:
        return None
    exporting, sampling = made, made.sampling
    _tracer = None
    atexit.register(made.shutdown)  # what is still queued is sent as the process stops
    return made


def shutdown() -> None:
    """Send what is queued and turn tracing off."""
    global exporting, sampling, _tracer
    made, exporting, sampling, _tracer = exporting, None, None, None
    if made is not None:
        atexit.unregister(made.shutdown)
        made.shutdown()


def flush(timeout_s: float = 5.0) -> bool:
    return exporting.flush(timeout_s) if exporting is not None else True


def tracer() -> Tracer | None:
    """The SDK tracer of live spans (Celery tasks), on this process's pipeline and sampling;
    None when tracing is off."""
    global _tracer
    if exporting is None:
        return None
    if _tracer is None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        assert sampling is not None
        ratio = TraceIdRatioBased(sampling.ratio)
        provider = TracerProvider(
            sampler=ParentBased(ratio) if sampling.follow_parent else ratio,
            resource=exporting.resource,
            shutdown_on_exit=False,  # the pipeline's own shutdown sends what is queued
        )
        provider.add_span_processor(exporting.processor)
        _tracer = provider.get_tracer("switchyard", __version__)
    return _tracer


# Celery --------------------------------------------------------------------------------------

_HEADER = "traceparent"
_running: dict[str, tuple[Any, object]] = {}  # task id -> (its span, the context token)


def trace_celery() -> None:
    """Connect the task signals (once; they cost a test each while tracing is off), and set up
    a worker process's pipeline as it starts."""
    from celery import signals

    signals.worker_process_init.connect(_worker_started, weak=False)
    signals.before_task_publish.connect(_publishing, weak=False)
    signals.task_prerun.connect(_task_started, weak=False)
    signals.task_postrun.connect(_task_ended, weak=False)
    signals.task_failure.connect(_task_failed, weak=False)


def _worker_started(**_kw: Any) -> None:
    # Sent in each process that runs tasks (a prefork child, or the solo pool's one), where the
    # pipeline starts: nothing made before a fork (a gRPC channel, a thread) is carried over.
    configure("switchyard-worker")


def _publishing(headers: dict[str, Any] | None = None, **_kw: Any) -> None:
    """The queueing task's context (if a traced one queues it) travels with the message."""
    if exporting is None or headers is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    context = span.get_span_context()
    if context.is_valid:
        flags = f"{int(context.trace_flags):02x}"
        headers[_HEADER] = f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags}"


def _task_started(task_id: str = "", task: Any = None, **_kw: Any) -> None:
    live = tracer()
    if live is None or task is None:
        return
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

    parent = None
    # A header from the broker is checked like a client's: a malformed one starts a new trace.
    parsed = shared.parse_traceparent(_traceparent_of(task.request))
    if parsed is not None:
        trace_id, span_id, flags = parsed
        remote = SpanContext(
            int(trace_id, 16), int(span_id, 16), True, TraceFlags(int(flags, 16) & 1)
        )
        parent = trace.set_span_in_context(NonRecordingSpan(remote))
    delivery = getattr(task.request, "delivery_info", None) or {}
    attributes = {
        "messaging.system": "celery",
        "messaging.operation.type": "process",
        "messaging.message.id": task_id,
        "messaging.destination.name": str(delivery.get("routing_key") or "celery"),
        "celery.task.name": task.name,
    }
    span = live.start_span(
        f"process {task.name}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
    )
    token = otel_context.attach(trace.set_span_in_context(span))
    _running[task_id] = (span, token)


def _traceparent_of(request: Any) -> str | None:
    # A worker sets a message's own headers as the request's attributes; a task run in process
    # (``apply``) keeps them in ``request.headers``.
    value = getattr(request, _HEADER, None) or (getattr(request, "headers", None) or {}).get(
        _HEADER
    )
    return value if isinstance(value, str) else None


def _task_failed(task_id: str = "", exception: BaseException | None = None, **_kw: Any) -> None:
    entry = _running.get(task_id)
    if entry is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span = entry[0]
    # The exception's type only: its message may hold the task's data.
    span.set_attribute("error.type", type(exception).__qualname__ if exception else "error")
    span.set_status(Status(StatusCode.ERROR))


def _task_ended(task_id: str = "", state: str | None = None, **_kw: Any) -> None:
    entry = _running.pop(task_id, None)
    if entry is None:
        return
    from opentelemetry import context as otel_context

    span, token = entry
    if state:
        span.set_attribute("celery.state", state)
    otel_context.detach(token)  # type: ignore[arg-type]
    span.end()
