"""Fixtures that start a whole platform: backend, ASGI server, one serving agent."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from tests.onnx_models import slow_onnx, small_onnx

from .harness import (
    AGENT_SEED,
    NO_SEED,
    STACK_SEED,
    Backend,
    Proc,
    Seed,
    create_node,
    create_tenant,
    embedded_backend,
    free_port,
    services_available,
    services_backend,
    start_agent,
    start_celery,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.e2e

BACKENDS = ["embedded", "services"]
SERVERS = ["uvicorn", "daphne"]


def make_backend(name: str, tmp, seed: Seed = NO_SEED) -> Backend:
    """A backend of its own; ``seed``: rows its database starts with, which create_node and
    create_tenant then hand out instead of making them (harness.STACK_SEED)."""
    if name == "services":
        if not services_available():
            pytest.skip("DATABASE_URL (PostgreSQL) and REDIS_URL are not set")
        return services_backend(tmp, seed)
    return embedded_backend(tmp, seed)


@dataclass
class Stack:
    backend: Backend
    server: Proc
    agent: Proc
    url: str
    key_a: str
    key_b: str
    node_token: str
    artifact: bytes

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key or self.key_a}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


def upload_and_promote(client: httpx.Client, name: str, artifact: bytes, **fields) -> dict:
    if client.get(f"/api/v1/models/{name}").status_code == 404:
        created = client.post("/api/v1/models", json={"name": name, "task": "classifier"})
        assert created.status_code == 201, created.text
    files = {"artifact": ("model.onnx", artifact, "application/octet-stream")}
    version = client.post(f"/api/v1/models/{name}/versions", files=files, data=fields)
    assert version.status_code == 201, version.text
    number = version.json()["version"]
    moved = client.put(f"/api/v1/models/{name}/aliases/production", json={"version": number})
    assert moved.status_code == 200, moved.text
    return version.json()


def wait_ready(client: httpx.Client, name: str, timeout: float = 30, proc: Proc | None = None):
    wait_until(lambda: client.get(f"/v2/models/{name}/ready").status_code == 200, timeout, proc)


@pytest.fixture(
    scope="module",
    params=[(b, s) for b in BACKENDS for s in SERVERS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def stack(request, tmp_path_factory):
    backend_name, server_kind = request.param
    backend = make_backend(backend_name, tmp_path_factory.mktemp(backend_name), STACK_SEED)
    port = free_port()
    server = start_server(backend, server_kind, port)
    url = f"http://127.0.0.1:{port}"
    node_token = create_node(backend, "node-1")
    agent = start_agent(backend, url, node_token)
    s = Stack(
        backend,
        server,
        agent,
        url,
        create_tenant(backend, "alpha"),
        create_tenant(backend, "beta"),
        node_token,
        small_onnx(),
    )
    with s.client() as client:
        upload_and_promote(client, "clf", s.artifact)
        wait_ready(client, "clf", proc=agent)
    yield s
    agent.stop()
    server.stop()
    backend.close()


@contextmanager
def platform_with_agent(
    backend_name: str, tmp, env: dict | None = None, celery: bool = False, seed: Seed = NO_SEED
):
    """A backend, a uvicorn server and one agent (and Celery worker and beat if asked);
    yields (backend, url, processes) and stops everything afterwards. ``seed``: the rows the
    test needs besides the agent's node (harness.Seed), made with the template."""
    backend = make_backend(backend_name, tmp, AGENT_SEED + seed)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The platform's own processes (batch jobs in the worker) call its front door here.
    backend.env["SWITCHYARD_PLATFORM_URL"] = url
    backend.env.update(env or {})
    procs = [start_server(backend, "uvicorn", port)]
    try:
        procs.append(start_agent(backend, url, create_node(backend, "n")))
        if celery:
            procs += [start_celery(backend, "worker"), start_celery(backend, "beat")]
        yield backend, url, procs
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()


GUARDRAILS = {"max_error_rate_increase": 0.05, "max_p99_ratio": 3, "min_samples": 20}


def plan_towards_slow_candidate(client: httpx.Client, **plan: object) -> dict:
    """Model ``clf``: a fast v1 in production, a slow v2 (~5 ms a row), and a plan towards v2."""
    upload_and_promote(client, "clf", small_onnx())
    files = {"artifact": ("slow.onnx", slow_onnx(depth=96), "application/octet-stream")}
    assert client.post("/api/v1/models/clf/versions", files=files).status_code == 201
    body = {"candidate": 2, "guardrails": GUARDRAILS, **plan}
    response = client.post("/api/v1/models/clf/rollouts", json=body)
    assert response.status_code == 201, response.text
    return response.json()
