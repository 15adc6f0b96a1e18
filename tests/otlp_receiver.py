"""A real OTLP trace receiver for tests: the collector's TraceService over gRPC, or POST
/v1/traces (protobuf) over HTTP, on a free port of 127.0.0.1, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Span:
    """One received span, ids as hex, attributes as plain values."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    error: bool


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Receiver:
    protocol: str  # "grpc" or "http/protobuf"
    port: int = 0
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **more: str) -> dict[str, str]:
        """The environment that points a process's spans here (exported every 100 ms)."""
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": self.protocol,
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            **more,
        }

    def take(self, raw: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(raw)
        got = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    got.append(
                        Span(
                            service=service,
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=tuple(e.name for e in s.events),
                            error=s.status.code == 2,  # STATUS_CODE_ERROR
                        )
                    )
        with self._lock:
            self.requests += 1
            self.spans.extend(got)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, count: int, timeout: float = 15) -> list[Span]:
        """The trace's spans once at least ``count`` arrived (what did, after ``timeout``)."""
        return self._wait(lambda s: s.trace_id == trace_id, count, timeout)

    def wait_for_name(self, name: str, count: int, timeout: float = 15) -> list[Span]:
        """The spans called ``name`` once at least ``count`` arrived."""
        return self._wait(lambda s: s.name == name, count, timeout)

    def _wait(self, wanted: Callable[[Span], bool], count: int, timeout: float) -> list[Span]:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                got = [s for s in self.spans if wanted(s)]
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the proto's name
        self.receiver.take(request.SerializeToString())
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def otlp_receiver(protocol: str) -> Iterator[Receiver]:
    """A receiver speaking ``protocol`` ("grpc" or "http/protobuf"), stopped afterwards."""
    receiver = Receiver(protocol)
    if protocol == "grpc":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(receiver), server)
        receiver.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            yield receiver
        finally:
            server.stop(None)
        return

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path != "/v1/traces" or "protobuf" not in self.headers.get("Content-Type", ""):
                self.send_response(404)
                self.end_headers()
                return
            receiver.take(raw)
            body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        httpd.shutdown()
        httpd.server_close()
