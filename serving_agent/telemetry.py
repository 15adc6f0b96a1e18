"""OpenTelemetry spans, shared by the agent and the platform: configured by OpenTelemetry's own
environment variables, off unless ``OTEL_TRACES_EXPORTER=otlp`` (or ``console``).

Spans are recorded *after* the work they describe, from times already taken (the gateway's
stage marks, the batcher's queue and run times), under the ids the W3C ``traceparent`` already
named: a request whose trace is not sampled pays one flag test and no SDK object is made for
it. ``opentelemetry`` is imported only when tracing is on, so an agent installed without the
``otel`` extra runs as before (and records nothing). The platform builds on this module
(``platform_site.telemetry``): the agent is below it in the dependency rule, so the settings
are read in one place and mean the same on both sides.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .__version__ import __version__

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

# version "00", 32 hex trace id, 16 hex parent span id, 2 hex flags (W3C Trace Context, level 1)
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
ZERO_TRACE, ZERO_SPAN = "0" * 32, "0" * 16
_ODD = frozenset("13579bdf")  # a flags byte's second hex digit with the "sampled" bit set

# OTEL_TRACES_SAMPLER's values: (follows the parent's decision, the ratio; None: the argument's)
SAMPLERS: dict[str, tuple[bool, float | None]] = {
    "always_on": (False, 1.0),
    "always_off": (False, 0.0),
    "traceidratio": (False, None),
    "parentbased_always_on": (True, 1.0),
    "parentbased_always_off": (True, 0.0),
    "parentbased_traceidratio": (True, None),
}
DEFAULT_SAMPLER = "parentbased_always_on"  # OpenTelemetry's own default
PROTOCOLS = ("http/protobuf", "grpc")  # the first is the default, as OpenTelemetry's spec says

Attributes = Mapping[str, str | bool | int | float | Sequence[str]]


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid ``traceparent``, else None: a client's or
    an agent's malformed value is ignored, never an error."""
    if not value or len(value) > 128:
        return None
    match = TRACEPARENT.match(value.strip().lower())
    if match is None or match[1] == ZERO_TRACE or match[2] == ZERO_SPAN:
        return None
    return match[1], match[2], match[3]


def sampled(flags: str) -> bool:
    """Whether a traceparent's (valid, hex) flags carry the "sampled" bit."""
    return len(flags) == 2 and flags[1] in _ODD


def new_span_id() -> str:
    """A span id (16 hex digits, never all zeros). Ids need to be unique, not secret."""
    while True:
        span_id = random.randbytes(8).hex()
        if span_id != ZERO_SPAN:
            return span_id


@dataclass(frozen=True, slots=True)
class Sampling:
    """Which traces are recorded: a new trace when its id's low 64 bits fall below ``bound``
    (OpenTelemetry's TraceIdRatioBased rule, so every process decides a trace alike), one
    with a parent as the parent decided when ``follow_parent``."""

    follow_parent: bool
    bound: int

    @property
    def ratio(self) -> float:
        return self.bound / 2**64

    def root(self, trace_id: str) -> bool:
        return self.bound > 0 and int(trace_id[16:], 16) < self.bound


def sampling_from_env(env: Mapping[str, str]) -> Sampling:
    """``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``; an unknown value is logged and
    the default used, as OpenTelemetry's SDKs do."""
    name = (env.get("OTEL_TRACES_SAMPLER") or DEFAULT_SAMPLER).strip().lower()
    if name not in SAMPLERS:
        log.warning(
            "OTEL_TRACES_SAMPLER=%r is not one of %s: using %s", name, SAMPLERS, DEFAULT_SAMPLER
        )
        name = DEFAULT_SAMPLER
    follow_parent, ratio = SAMPLERS[name]
    if ratio is None:
        raw = env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            ratio = float(raw)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:  # NaN fails both
            log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a ratio in [0, 1]: using 1.0", raw)
            ratio = 1.0
    return Sampling(follow_parent, round(ratio * 2**64))


def exporter_from_env(env: Mapping[str, str]) -> SpanExporter:
    """The OTLP exporter ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` names (the exporters read
    their endpoint, headers, TLS and timeout settings from the environment themselves)."""
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or PROTOCOLS[0]
    ).strip()
    if protocol not in PROTOCOLS:
        log.warning(
            "OTLP protocol %r is not one of %s: using %s", protocol, PROTOCOLS, PROTOCOLS[0]
        )
        protocol = PROTOCOLS[0]
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()


class Exporting:
    """One process's span pipeline: its resource, a batch processor (a thread that exports in
    the background: recording a span is a queue append) and an exporter.

    ``span`` records a finished span under ids and times the caller gives. The SDK's tracer
    cannot take a span id from its caller, and the ids here were fixed before the work (the
    gateway answers its span's id in the response's traceparent and sends it to the agent), so
    the finished span is handed to the processor as the tracer itself would."""

    def __init__(
        self,
        service_name: str,
        sampling: Sampling,
        exporter: SpanExporter,
        env: Mapping[str, str] = os.environ,
    ) -> None:
        from opentelemetry import trace as api
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.status import Status, StatusCode

        # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME (which wins).
        attributes = {"service.name": env.get("OTEL_SERVICE_NAME") or service_name}
        self.resource = Resource.create(attributes)
        self.sampling = sampling
        self.exporter = exporter
        self.processor: SpanProcessor = BatchSpanProcessor(exporter)
        self.scope = InstrumentationScope("switchyard", __version__)
        self._clock_offset_ns = time.time_ns() - time.perf_counter_ns()
        # Made once: ``span`` runs for every span of every sampled request.
        self._context, self._span, self._event = api.SpanContext, ReadableSpan, Event
        self._flags = api.TraceFlags(api.TraceFlags.SAMPLED)
        self._kinds = {kind.name.lower(): kind for kind in api.SpanKind}
        self._unset, self._error = Status(StatusCode.UNSET), Status(StatusCode.ERROR)

    def epoch_ns(self, perf_s: float) -> int:
        """A ``time.perf_counter()`` reading as Unix nanoseconds (spans carry wall-clock times;
        the hot path takes the cheaper monotonic clock)."""
        return self._clock_offset_ns + int(perf_s * 1e9)

    def span(
        self,
        name: str,
        trace_id: str,
        span_id: str,
        parent_id: str | None,
        start_ns: int,
        end_ns: int,
        *,
        kind: str = "internal",
        attributes: Attributes | None = None,
        error: str | None = None,
        events: Iterable[tuple[str, int, Attributes]] = (),
        remote_parent: bool = False,
    ) -> None:
        """Record one finished, sampled span. ``error``: why it failed (an ``error.type``,
        never a message that could hold a client's data), None when it did not."""
        flags, tid = self._flags, int(trace_id, 16)
        context = self._context(tid, int(span_id, 16), False, flags)
        parent = self._context(tid, int(parent_id, 16), remote_parent, flags) if parent_id else None
        if error is not None:
            attributes = {**(attributes or {}), "error.type": error}
        span = self._span(
            name,
            context=context,
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            events=[self._event(n, a, timestamp=t) for n, t, a in events],
            kind=self._kinds[kind],
            status=self._unset if error is None else self._error,
            start_time=start_ns,
            end_time=max(end_ns, start_ns),
            instrumentation_scope=self.scope,
        )
        self.processor.on_end(span)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self.processor.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        self.processor.shutdown()


def from_env(service_name: str, env: Mapping[str, str] = os.environ) -> Exporting | None:
    """The process's span pipeline as the environment configures it, or None (off: the
    default, ``OTEL_TRACES_EXPORTER`` unset or ``none``, or ``OTEL_SDK_DISABLED=true``). An
    agent without the ``otel`` extra logs that it cannot trace and runs on."""
    exporter_name = (env.get("OTEL_TRACES_EXPORTER") or "none").strip().lower()
    if exporter_name == "none" or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if exporter_name not in ("otlp", "console"):
        log.warning(
            "OTEL_TRACES_EXPORTER=%r: only otlp, console and none are supported; tracing is off",
            exporter_name,
        )
        return None
    sampling = sampling_from_env(env)
    try:
        if exporter_name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter: SpanExporter = ConsoleSpanExporter()
        else:
            exporter = exporter_from_env(env)
        return Exporting(service_name, sampling, exporter, env)
    except ImportError as exc:
        log.warning(
            "OTEL_TRACES_EXPORTER=%s but OpenTelemetry is not installed (%s): tracing is off "
            "(install the agent's otel extra)",
            exporter_name,
            exc,
        )
        return None


# The agent's pipeline (``configure``); None: off.
exporting: Exporting | None = None


def configure(
    service_name: str = "switchyard-agent", env: Mapping[str, str] = os.environ
) -> Exporting | None:
    """Set up (or replace) the agent's span pipeline from the environment."""
    global exporting
    if exporting is not None:
        atexit.unregister(exporting.shutdown)
        exporting.shutdown()
    exporting = from_env(service_name, env)
    if exporting is not None:
        atexit.register(exporting.shutdown)  # what is still queued is sent as the agent stops
    return exporting
