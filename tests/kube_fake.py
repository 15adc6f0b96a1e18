"""A small fake Kubernetes API server for apps/v1 Deployments and their scale subresource.

It answers the way the real one does where our backend cares: JSON objects with
``metadata.resourceVersion`` bumped on every write, Status objects for errors, 409 for a write
carrying a stale resourceVersion, ``dryRun=All`` validated but not stored. Faults can be queued
to answer the next matching request, and every request is logged.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

PATH = re.compile(
    r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/deployments(?:/(?P<name>[^/]+)(?P<scale>/scale)?)?$"
)
REASONS = {404: "NotFound", 409: "Conflict", 429: "TooManyRequests", 503: "ServiceUnavailable"}
PATCH_TYPES = {
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
}


@dataclass
class Fault:
    """Answer the next request whose method matches and whose path contains ``path``: with an
    error status; ``"slow:0.5"``: sleep, then answer normally; ``"bump"``: first change the
    object's resourceVersion, as a concurrent writer would, then answer normally."""

    method: str
    path: str
    answer: int | str


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None
    body: Any
    status: int = 0


@dataclass
class FakeKube:
    """The server's state; tests read and change it directly."""

    deployments: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    log: list[Request] = field(default_factory=list)
    version: int = 100
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def fail(self, method: str, path: str, answer: int | str, times: int = 1) -> None:
        self.faults.extend(Fault(method, path, answer) for _ in range(times))

    def replicas(self, name: str, namespace: str = "ml") -> int:
        return self.deployments[(namespace, name)]["spec"]["replicas"]

    def writes(self) -> list[Request]:
        return [r for r in self.log if r.method != "GET"]

    def bump(self, path: str) -> None:
        """A concurrent writer: the stored object gets a new resourceVersion."""
        match = PATH.match(path)
        if match and (match["ns"], match["name"]) in self.deployments:
            self.deployments[(match["ns"], match["name"])]["metadata"]["resourceVersion"] = (
                self.next_version()
            )

    def next_version(self) -> str:
        self.version += 1
        return str(self.version)


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch; close enough to a strategic merge for the fields we patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def as_scale(deployment: dict[str, Any]) -> dict[str, Any]:
    meta = deployment["metadata"]
    replicas = deployment["spec"].get("replicas", 1)
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
            "resourceVersion": meta["resourceVersion"],
            "creationTimestamp": meta["creationTimestamp"],
        },
        "spec": {"replicas": replicas},
        "status": {"replicas": deployment.get("status", {}).get("replicas", 0)},
    }


class Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self.handle_api("GET")

    def do_POST(self) -> None:
        self.handle_api("POST")

    def do_PUT(self) -> None:
        self.handle_api("PUT")

    def do_PATCH(self) -> None:
        self.handle_api("PATCH")

    def do_DELETE(self) -> None:
        self.handle_api("DELETE")

    def handle_api(self, method: str) -> None:
        kube = self.server.kube
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        content_type = (self.headers.get("Content-Type") or "").split(";")[0] or None
        request = Request(
            method, url.path, parse_qs(url.query), content_type, json.loads(raw) if raw else None
        )
        with kube.lock:
            kube.log.append(request)
            fault = next(
                (f for f in kube.faults if f.method == method and f.path in url.path), None
            )
            if fault:
                kube.faults.remove(fault)
        if fault and isinstance(fault.answer, str) and fault.answer.startswith("slow:"):
            time.sleep(float(fault.answer.removeprefix("slow:")))
        if fault and isinstance(fault.answer, int):
            reason = REASONS.get(fault.answer, "InternalError")
            code, body = fault.answer, status(fault.answer, reason, f"injected {reason}")
        else:
            with kube.lock:
                if fault and fault.answer == "bump":
                    kube.bump(url.path)
                code, body = self.answer(kube, method, url.path, request)
        request.status = code
        self.send_json(code, body)

    def send_json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out and left, as it should

    def answer(
        self, kube: FakeKube, method: str, path: str, req: Request
    ) -> tuple[int, dict[str, Any]]:
        match = PATH.match(path)
        if not match:
            return 404, status(404, "NotFound", f"the server could not find {path}")
        ns, name, scale = match["ns"], match["name"], bool(match["scale"])
        dry_run = req.query.get("dryRun") == ["All"]
        if req.query.get("dryRun") not in (None, ["All"]):
            return 400, status(400, "BadRequest", f"invalid dry run option {req.query['dryRun']}")
        # Like kube-apiserver, a body without Content-Type is read as JSON (the client sends
        # POST and PUT bodies that way).
        if method in ("PUT", "POST") and req.content_type not in (None, "application/json"):
            return 415, status(415, "UnsupportedMediaType", f"bad type {req.content_type}")
        if method == "PATCH" and req.content_type not in PATCH_TYPES:
            return 415, status(415, "UnsupportedMediaType", f"bad type {req.content_type}")

        if method == "POST" and name is None:
            return self.create(kube, ns, req.body, dry_run)
        if name is None:
            return 405, status(405, "MethodNotAllowed", "not implemented by the fake")
        current = kube.deployments.get((ns, name))
        if current is None:
            return 404, status(404, "NotFound", f'deployments.apps "{name}" not found')
        if method == "GET":
            return 200, as_scale(current) if scale else current
        if method == "DELETE":
            if not dry_run:
                del kube.deployments[(ns, name)]
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}

        body = req.body or {}
        sent_version = (body.get("metadata") or {}).get("resourceVersion")
        if sent_version is not None and sent_version != current["metadata"]["resourceVersion"]:
            return 409, status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on deployments.apps "{name}": the object has '
                "been modified; please apply your changes to the latest version and try again",
            )
        updated = copy.deepcopy(current)
        if scale:
            replicas = (body.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return 422, status(422, "Invalid", "spec.replicas must be a non-negative integer")
            updated["spec"]["replicas"] = replicas
        elif method == "PUT":
            if body.get("kind") != "Deployment":
                return 400, status(400, "BadRequest", "body is not a Deployment")
            updated = copy.deepcopy(body)
            updated["metadata"] = {
                **current["metadata"],
                **{k: v for k, v in body["metadata"].items() if k in ("labels", "annotations")},
            }
            updated["status"] = current.get("status", {})
        else:
            merge(updated, body)
        updated["metadata"]["resourceVersion"] = (
            current["metadata"]["resourceVersion"] if dry_run else kube.next_version()
        )
        if not dry_run:
            kube.deployments[(ns, name)] = updated
        return 200, as_scale(updated) if scale else updated

    def create(
        self, kube: FakeKube, ns: str, body: Any, dry_run: bool
    ) -> tuple[int, dict[str, Any]]:
        if not isinstance(body, dict) or body.get("kind") != "Deployment":
            return 400, status(400, "BadRequest", "body is not a Deployment")
        name = body.get("metadata", {}).get("name")
        spec = body.get("spec") or {}
        if not name or "selector" not in spec or "template" not in spec:
            return 422, status(422, "Invalid", "name, spec.selector and spec.template required")
        if (ns, name) in kube.deployments:
            return 409, status(409, "AlreadyExists", f'deployments.apps "{name}" already exists')
        created = copy.deepcopy(body)
        created["metadata"].update(
            namespace=ns,
            uid=f"uid-{name}",
            creationTimestamp="2025-01-01T00:00:00Z",
            generation=1,
            resourceVersion=str(kube.version) if dry_run else kube.next_version(),
        )
        created["spec"].setdefault("replicas", 1)
        created["status"] = {}
        if not dry_run:
            kube.deployments[(ns, name)] = created
        return 201, created


class _Server(ThreadingHTTPServer):
    kube: FakeKube


class FakeKubeServer:
    """Runs the fake on 127.0.0.1 on a free port in a daemon thread; a context manager."""

    def __init__(self) -> None:
        self.kube = FakeKube()
        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.kube = self.kube
        self.kube.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> FakeKube:
        self.thread.start()
        return self.kube

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
