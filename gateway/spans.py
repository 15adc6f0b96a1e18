"""The gateway's OpenTelemetry spans of a sampled request, made after its reply.

A request is timed anyway: ``Observed.mark`` charges each stage (auth, rate_limit, routing,
serialization, dispatch) for the metrics. A sampled request gets a ``Timeline`` instead, an
``Observed`` that also keeps when each stage ended; once the reply is sent, ``export`` turns
it into the door's span (the id the response's ``traceparent`` and the agent's frame named)
and a child span per stage, with the times already taken. An unsampled request pays one test
when its ``Call`` is made (tracing off: none beyond ``start_trace``'s), and no SDK object is
made for it. The tree, attributes and configuration: docs/observability.md, "Traces".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

from platform_site import telemetry
from serving_agent.telemetry import Attributes, Exporting, new_span_id

from .metrics import Observed
from .routes import Route
from .tracing import Trace

log = logging.getLogger(__name__)

Described = tuple[str, str, dict[str, Any], str | None]  # name, kind, attributes, error type


class Door:
    """What a front door's span says of its request, read (for a sampled request only) from
    the object the door gave its ``Call``: the ASGI scope, Django's request, a URL."""

    def describe(self, where: Any, status: int) -> Described:
        raise NotImplementedError


class HttpDoor(Door):
    """An HTTP server span (OpenTelemetry's HTTP conventions): ``{method} {http.route}``."""

    def __init__(
        self,
        route: str | Callable[[str], str],
        read: Callable[[Any], tuple[str, str]],
        gen_ai_operation: str | None = None,
    ) -> None:
        self.route = route  # the path's template, or how to make it from the path
        self.read = read  # (method, path) of the door's request object
        self.gen_ai_operation = gen_ai_operation

    def describe(self, where: Any, status: int) -> Described:
        method, path = self.read(where)
        route = self.route if isinstance(self.route, str) else self.route(path)
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": path,
            "http.route": route,
            "http.response.status_code": status,
        }
        if self.gen_ai_operation is not None:
            attributes["gen_ai.operation.name"] = self.gen_ai_operation
        # A server span fails on a 5xx only: a 4xx is the client's (the conventions' rule).
        return f"{method} {route}", "server", attributes, str(status) if status >= 500 else None


class RpcDoor(Door):
    """A gRPC server span (OpenTelemetry's RPC conventions): ``{service}/{method}``."""

    # The codes a server span counts as its own failure (the conventions' list).
    SERVER_ERRORS = frozenset({2, 4, 12, 13, 14, 15})  # UNKNOWN .. DATA_LOSS

    def __init__(self, service: str, method: str, code_of: Callable[[int], int]) -> None:
        self.service, self.method, self.code_of = service, method, code_of

    def describe(self, where: Any, status: int) -> Described:
        code = 0 if status == 200 else self.code_of(status)
        attributes: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": self.service,
            "rpc.method": self.method,
            "rpc.grpc.status_code": code,
        }
        error = str(code) if code in self.SERVER_ERRORS else None
        return f"{self.service}/{self.method}", "server", attributes, error


class StreamDoor(Door):
    """One generation on the websocket (no conventions for these): the socket's route."""

    def __init__(self, route: str, read: Callable[[Any], str]) -> None:
        self.route, self.read = route, read

    def describe(self, where: Any, status: int) -> Described:
        attributes: dict[str, Any] = {
            "url.path": self.read(where),
            "http.route": self.route,
            "switchyard.status_code": status,
            "gen_ai.operation.name": "text_completion",
        }
        return (
            f"generate {self.route}",
            "server",
            attributes,
            str(status) if status >= 500 else None,
        )


def scope_request(scope: Any) -> tuple[str, str]:
    """(method, path) of an ASGI scope."""
    return scope["method"], scope["path"]


def oip_route(path: str) -> str:
    """``http.route`` of an OIP v2 path: the model and version as placeholders."""
    parts = path.rstrip("/").split("/")
    if len(parts) < 4 or parts[2] != "models":
        return "/".join(parts) or "/"
    route = ["", "v2", "models", "{model}"]
    rest = parts[4:]
    if rest[:1] == ["versions"]:
        route += ["versions", "{version}"]
        rest = rest[2:]
    return "/".join(route + rest[:1])


class Timeline(Observed):
    """A sampled request's ``Observed``: its stages' end times too, the agent's times of each
    dispatch, and its graph nodes' spans, for ``export`` once the reply is sent."""

    __slots__ = ("door", "where", "marks", "nodes")

    def __init__(self, trace: Trace, door: Door, where: Any) -> None:
        super().__init__(trace)
        self.door, self.where = door, where
        self.marks: list[tuple[str, float, dict[str, Any] | None]] = []
        self.nodes: list[NodeSpan] = []

    def mark(self, stage: str) -> None:
        super().mark(stage)
        self.marks.append((stage, self._last, None))

    def agent_times(self, queue_ms: float, compute_ms: float) -> None:
        super().agent_times(queue_ms, compute_ms)
        if self.marks:  # the dispatch just marked: the agent's own account of it
            stage, at, _ = self.marks[-1]
            times = {
                "switchyard.agent.queue_ms": queue_ms,
                "switchyard.agent.compute_ms": compute_ms,
            }
            self.marks[-1] = (stage, at, times)


def export(timeline: Timeline, status: int) -> None:
    """The spans of a sampled request, once its reply is sent: the door's, and one per stage
    (its children; the agent's own spans are children of the door's too, the span its frame
    named). A failure here is logged, never the request's: the work queued after the reply
    (shadow copies) still starts."""
    try:
        _export(timeline, status)
    except Exception:
        log.exception("could not record the spans of request %s", timeline.trace.request_id)


def _export(timeline: Timeline, status: int) -> None:
    exporting = telemetry.exporting
    if exporting is None:  # turned off since the request came
        return
    ended = time.perf_counter()
    trace = timeline.trace
    name, kind, attributes, error = timeline.door.describe(timeline.where, status)
    attributes.update(request_attributes(timeline))
    if "gen_ai.operation.name" in attributes and timeline.route is not None:  # embeddings
        attributes["gen_ai.request.model"] = timeline.route.model_name
    tid, door_id = trace.trace_id, trace.span_id
    exporting.span(
        name,
        tid,
        door_id,
        trace.parent_id or None,
        exporting.epoch_ns(timeline.started),
        exporting.epoch_ns(ended),
        kind=kind,
        attributes=attributes,
        error=error,
        remote_parent=True,
    )
    last = timeline.started
    for stage, at, extra in timeline.marks:
        start_ns, end_ns = exporting.epoch_ns(last), exporting.epoch_ns(at)
        exporting.span(
            f"switchyard.{stage}", tid, new_span_id(), door_id, start_ns, end_ns, attributes=extra
        )
        last = at
    for node in timeline.nodes:
        node.export(exporting, tid, door_id)


def request_attributes(observed: Observed) -> dict[str, Any]:
    """Who called what: the tenant, the model, version and arm that answered (never a key,
    an input or an output)."""
    attributes: dict[str, Any] = {"switchyard.request.id": observed.trace.request_id}
    if observed.tenant:
        attributes["switchyard.tenant"] = observed.tenant
    route = observed.route
    if route is not None:
        attributes["switchyard.model"] = route.model_name
        attributes["switchyard.version"] = route.version
    if observed.arm:
        attributes["switchyard.arm"] = observed.arm
    return attributes


# Graph nodes ---------------------------------------------------------------------------------

# The span of the graph node now running in this task (nested graphs' nodes are its children).
_node: ContextVar[NodeSpan | None] = ContextVar("switchyard_graph_node", default=None)


class NodeSpan:
    """One node of a sampled graph request: its span is the parent of its agent's spans (its
    dispatch carries ``trace``), of its nested graph's nodes, and a child of the enclosing
    node's span or the door's."""

    __slots__ = (
        "name",
        "graph",
        "parent",
        "span_id",
        "trace",
        "started",
        "ended",
        "status",
        "_token",
    )

    def __init__(self, timeline: Timeline, name: str, graph: Route) -> None:
        enclosing = _node.get()
        self.name, self.graph = name, graph
        self.parent: str | None = enclosing.span_id if enclosing is not None else None
        self.span_id: str = new_span_id()
        self.trace = replace(timeline.trace, span_id=self.span_id)
        self.started = time.perf_counter()
        self.ended = 0.0
        self.status = 499  # until it ends: a node whose request was cancelled
        self._token = _node.set(self)
        timeline.nodes.append(self)

    def close(self, status: int | None) -> None:
        self.ended = time.perf_counter()
        if status is not None:
            self.status = status
        _node.reset(self._token)

    def export(self, exporting: Exporting, trace_id: str, door_id: str) -> None:
        attributes: Attributes = {
            "switchyard.graph.node": self.name,
            "switchyard.graph.model": self.graph.model_name,
            "switchyard.graph.version": self.graph.version,
            "switchyard.status_code": self.status,
        }
        exporting.span(
            "switchyard.graph.node",
            trace_id,
            self.span_id,
            self.parent or door_id,
            exporting.epoch_ns(self.started),
            exporting.epoch_ns(self.ended or self.started),
            attributes=attributes,
            error=str(self.status) if self.status >= 500 else None,
        )


def node_trace(default: Trace | None) -> Trace | None:
    """The trace a graph node's dispatch carries: its node's span when it has one."""
    node = _node.get()
    return node.trace if node is not None else default


# Generation ----------------------------------------------------------------------------------


def export_generation(
    trace: Trace,
    *,
    operation: str,
    route: Route,
    tenant: str,
    arm: str | None,
    started: float,
    input_tokens: int,
    output_tokens: int,
    ttft_ms: float | None,
    finish_reason: str | None,
    status: int,
) -> None:
    """The span of one generation (OpenTelemetry's GenAI conventions), a child of its door's,
    recorded when the stream closes (after its last token: a stream's door span may have
    ended at its first): tokens in and out, the time to the first token as an attribute and
    an event at that time. A failure is logged: the stream's close goes on."""
    exporting = telemetry.exporting
    if exporting is None:
        return
    try:
        model = route.model_name
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.response.model": f"{model}@{route.version}",
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "switchyard.tenant": tenant,
            "switchyard.model": model,
            "switchyard.version": route.version,
            "switchyard.status_code": status,
        }
        if arm:
            attributes["switchyard.arm"] = arm
        if finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = [finish_reason]
        events: list[tuple[str, int, Attributes]] = []
        if ttft_ms is not None:
            attributes["gen_ai.server.time_to_first_token"] = ttft_ms / 1000
            first = exporting.epoch_ns(started + ttft_ms / 1000)
            events.append(("gen_ai.first_token", first, {}))
        exporting.span(
            f"{operation} {model}",
            trace.trace_id,
            new_span_id(),
            trace.span_id,
            exporting.epoch_ns(started),
            exporting.epoch_ns(time.perf_counter()),
            attributes=attributes,
            events=events,
            error=str(status) if status >= 500 else None,
        )
    except Exception:
        log.exception("could not record the span of a generation (request %s)", trace.request_id)
