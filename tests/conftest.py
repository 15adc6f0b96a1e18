"""Shared fixtures: two tenants and an outsider, ``make_*`` factories, a small ONNX model."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.factories import make_key, make_member, make_tenant
from tests.onnx_models import small_onnx

E2E_DIR = Path(__file__).parent / "e2e"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """scripts/test.sh's unit pass does not collect tests/e2e (each pass collects only the files
    that can hold its tests): a test there that is not marked e2e would run in no pass."""
    unmarked = [
        item.nodeid
        for item in items
        if item.path.is_relative_to(E2E_DIR) and item.get_closest_marker("e2e") is None
    ]
    if unmarked:
        raise pytest.UsageError(f"tests under tests/e2e must be marked e2e: {unmarked}")


@pytest.fixture(scope="session")
def onnx_bytes() -> bytes:
    return small_onnx()


@dataclass
class World:
    """Tenant A (with an engineer, a viewer and a key), tenant B (with a key), an outsider."""

    a: object
    b: object
    key_a: str
    key_b: str
    engineer_a: object
    viewer_a: object
    outsider: object


@pytest.fixture
def world(db, django_user_model) -> World:
    a, b = make_tenant("alpha"), make_tenant("beta")
    return World(
        a=a,
        b=b,
        key_a=make_key(a)[1],
        key_b=make_key(b)[1],
        engineer_a=make_member(a, "eng-a", "engineer"),
        viewer_a=make_member(a, "viewer-a", "viewer"),
        outsider=django_user_model.objects.create_user("outsider", password="pw-outsider-1"),
    )


def redis_url() -> str | None:
    return os.environ.get("REDIS_URL") or None


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1)


class OwnRedis:
    """A redis-server of the test's own on a free port, which the test may stop and restart
    (the shared one on 6379 is never broken). ``args`` go first on its command line: a
    configuration file, then options that override it."""

    def __init__(self, *args: str) -> None:
        self.args = args
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        args = ["redis-server", *self.args, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def own_redis():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = OwnRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _gateway_db_calls_on_the_test_thread(request):
    """The gateway's database calls run on a thread pool in a server (``gateway.db``); a test's
    rows live in its transaction, which only its own thread sees, so tests keep the calls on
    Channels' one thread unless marked ``db_threads``."""
    if request.node.get_closest_marker("db_threads"):
        yield
        return
    from django.conf import settings

    threads = settings.SWITCHYARD_DB_THREADS
    settings.SWITCHYARD_DB_THREADS = 0
    yield
    settings.SWITCHYARD_DB_THREADS = threads


@pytest.fixture(autouse=True)
def _own_log_store(tmp_path_factory):
    """Each test logs predictions to a directory of its own (the Parquet log lives outside the
    database, so the test's transaction does not undo it)."""
    from django.conf import settings

    kept = settings.SWITCHYARD_LOG_ROOT
    settings.SWITCHYARD_LOG_ROOT = str(tmp_path_factory.mktemp("logs"))
    yield
    settings.SWITCHYARD_LOG_ROOT = kept


@pytest.fixture(autouse=True, scope="session")
def _fast_password_hashing():
    """Tests make many users (members, approvers, every test key's owner): PBKDF2's 1,000,000
    iterations cost 0.2-0.4 s per user here, several minutes over the suite. A test that checks
    a password only needs it to match; the platform itself keeps Django's hashers."""
    from django.conf import settings

    hashers = settings.PASSWORD_HASHERS
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    yield
    settings.PASSWORD_HASHERS = hashers


@pytest.fixture(autouse=True, scope="session")
def _no_servers_beside_the_asgi_application():
    """Tests call the ASGI application without a server, so no lifespan: its first scope would
    start the gRPC server (port 8001 by default) and the agents' link address on the test's
    event loop, which nothing stops (``platform_site.asgi.ProcessServers``). The tests of those
    servers turn them on themselves."""
    from django.conf import settings

    kept = settings.SWITCHYARD_GRPC_PORT, settings.SWITCHYARD_AGENT_LINKS
    settings.SWITCHYARD_GRPC_PORT, settings.SWITCHYARD_AGENT_LINKS = 0, False
    yield
    settings.SWITCHYARD_GRPC_PORT, settings.SWITCHYARD_AGENT_LINKS = kept
