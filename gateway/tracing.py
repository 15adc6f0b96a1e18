"""Request ids and W3C trace context, so one request can be followed from the client through
the gateway's logs, the agent's logs and the prediction log.

Every response carries ``x-request-id`` (the caller's, when it sent a valid one) and a
``traceparent`` naming the gateway's span; an incoming ``traceparent`` keeps its trace id.
The current request's ids live in a context variable, which a logging filter adds to every
record logged while it is handled.

The flags carry the sampling decision (``platform_site.telemetry``): "01" when this request's
spans are recorded, so the agent records its own under them, "00" when not (always, with
tracing off); a caller's decision is followed under the default parent-based sampler.
"""

from __future__ import annotations

import logging
import random
import re
from contextvars import ContextVar
from dataclasses import dataclass

from platform_site import telemetry

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# version "00", 32 hex trace id, 16 hex parent span id, 2 hex flags (W3C Trace Context, level 1)
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
_ODD = frozenset("13579bdf")  # a flags byte's low hex digit with the "sampled" bit set


class BadRequestId(ValueError):
    """The caller's x-request-id cannot be used (answered as 400)."""


@dataclass(slots=True, frozen=True)
class Trace:
    request_id: str
    trace_id: str
    span_id: str  # the gateway's span: what the agent and the response name as parent
    flags: str = "01"
    parent_id: str = ""  # the caller's span, from its valid traceparent

    @property
    def sampled(self) -> bool:
        """Whether this request's spans are recorded (its flags' "sampled" bit)."""
        return self.flags[1] in _ODD

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"

    def headers(self) -> list[tuple[str, str]]:
        return [(REQUEST_ID_HEADER, self.request_id), ("traceparent", self.traceparent)]


current: ContextVar[Trace | None] = ContextVar("switchyard_trace", default=None)


def start_trace(request_id: str | None, traceparent: str | None) -> Trace:
    """The ids of a new request. An invalid ``traceparent`` starts a new trace, as the W3C
    spec asks; an invalid ``x-request-id`` is refused, since the caller relies on it later
    (feedback is joined by it)."""
    # One draw for the three ids (request, trace, span: 32, 32 and 16 hex digits). Ids need to
    # be unique, not secret: the PRNG is ~2x cheaper than os.urandom, and one draw than three.
    fresh = random.randbytes(40).hex()
    if request_id is None or request_id == "":
        request_id = fresh[:32]
    elif not _REQUEST_ID.match(request_id):
        raise BadRequestId(
            "x-request-id: use 1-128 characters of letters, digits, '.', '_', ':' and '-'"
        )
    trace_id, flags, parent_id = fresh[32:64], "", ""
    if traceparent is not None:
        match = _TRACEPARENT.match(traceparent.strip().lower())
        if match and match[1] != _ZERO_TRACE and match[2] != _ZERO_SPAN:
            trace_id, parent_id, flags = match[1], match[2], match[3]
    span_id = fresh[64:]
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:  # W3C: all zeros is invalid
        return start_trace(request_id, traceparent)
    sampling = telemetry.sampling  # None: tracing is off, the one test it costs then
    if sampling is None:
        flags = flags or "00"  # nothing recorded here; a caller's decision is passed on
    elif not (flags and sampling.follow_parent):
        flags = "01" if sampling.root(trace_id) else "00"
    return Trace(request_id, trace_id, span_id, flags, parent_id)


class TraceLogFilter(logging.Filter):
    """Adds ``request_id`` and ``trace_id`` to every record ("-" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        trace = current.get()
        record.request_id = trace.request_id if trace else "-"
        record.trace_id = trace.trace_id if trace else "-"
        return True
