"""Real processes for end-to-end tests: the ASGI server (uvicorn or daphne), serving agents and
Celery, each on a backend: the embedded default (SQLite, no Redis) or PostgreSQL + Redis.
"""

from __future__ import annotations

import atexit
import datetime
import fcntl
import itertools
import json
import os
import platform
import re
import secrets
import select
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
# Each backend flushes the Redis database it takes and its Celery worker consumes that database's
# queue, so no two live backends may share one, even from two pytest runs on one Redis server
# (another CI job, another session's tests): with numbers from fixed ranges, one run flushed the
# other's database and its idle worker took the tasks the other's busy worker queued (a batch
# job's next chunk, every time). A backend holds its number with a lock file, which the kernel
# drops when the process ends; numbers 1-12 (0 is a platform's beside the tests, `make up`, and
# the unit tests' workers count down from 15, tests/workers.py).
REDIS_DBS = range(1, 13)
_worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
_redis_turn = itertools.count(6 * _worker)


def services_available() -> bool:
    return bool(
        os.environ.get("DATABASE_URL", "").startswith("postgres") and os.environ.get("REDIS_URL")
    )


@dataclass
class Backend:
    name: str
    env: dict[str, str]
    var_dir: Path
    cleanup: list[Any] = field(default_factory=list)
    # Rows the backend's database was copied with (its template's seed): what create_tenant and
    # create_node hand out, once each, instead of running manage.py (Seed).
    seeded: dict[tuple[Any, ...], str] = field(default_factory=dict)
    _manage_proc: subprocess.Popen[str] | None = field(default=None, repr=False)
    _manage_env: dict[str, str] = field(default_factory=dict, repr=False)

    def manage(self, *args: str, timeout: float = 120) -> str:
        """``manage.py *args`` in the backend's Django process (manage_runner): its stdout."""
        runner = self._runner()
        assert runner.stdin is not None and runner.stdout is not None
        runner.stdin.write(json.dumps(args) + "\n")
        runner.stdin.flush()
        ready, _, _ = select.select([runner.stdout], [], [], timeout)
        line = runner.stdout.readline() if ready else ""
        if not line:
            self.stop_runner()
            raise RuntimeError(f"manage.py {' '.join(args)} gave no answer within {timeout} s")
        answer = json.loads(line)
        if answer["rc"]:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{answer['stderr'][-3000:]}")
        return str(answer["stdout"])

    def _runner(self) -> subprocess.Popen[str]:
        """The backend's Django process, new if the environment changed since it started (the
        processes a test starts read what the test set; so must its commands)."""
        if self._manage_proc is not None and (
            self._manage_proc.poll() is not None or self._manage_env != self.env
        ):
            self.stop_runner()
        if self._manage_proc is None:
            self._manage_env = dict(self.env)
            with open(self.var_dir / f"manage-{uuid.uuid4().hex[:6]}.log", "wb") as log:
                self._manage_proc = subprocess.Popen(
                    [PY, "-m", "tests.e2e.manage_runner"],
                    cwd=ROOT,
                    env=self.env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
        return self._manage_proc

    def stop_runner(self) -> None:
        proc, self._manage_proc = self._manage_proc, None
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()  # it ends at the end of its input
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def shell(self, code: str) -> str:
        seeded = self.seeded.pop(("shell", code), None)
        if seeded is not None:
            return seeded
        return self.manage("shell", "-v", "0", "-c", code)

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of one read from the backend's database, straight from this process: a
        ``manage.py shell`` costs seconds of start-up, too slow (and too busy) for polling."""
        url = self.env.get("DATABASE_URL")
        if url is None:
            with sqlite3.connect(self.var_dir / "switchyard.sqlite3", timeout=20) as conn:
                return conn.execute(sql, params).fetchall()
        import psycopg

        with psycopg.connect(url.replace("postgres://", "postgresql://", 1)) as conn:
            return conn.execute(sql.replace("?", "%s"), params).fetchall()

    def agent_stats(self) -> dict[str, Any]:
        """The live agent session's latest heartbeat stats (the newest, if several)."""
        rows = self.query(
            "SELECT stats FROM gateway_agentsession WHERE disconnected_at IS NULL "
            "ORDER BY id DESC LIMIT 1"
        )
        if not rows:
            return {}
        stats = rows[0][0]
        # SQLite's JSON is text; PostgreSQL's jsonb arrives parsed.
        return dict(json.loads(stats) if isinstance(stats, str) else stats)

    def close(self) -> None:
        self.stop_runner()
        for step in reversed(self.cleanup):
            step()


METRICS_TOKEN = secrets.token_urlsafe(16)


def metrics_auth() -> dict[str, str]:
    """The header a scrape of /metrics of a platform started here needs."""
    return {"Authorization": f"Bearer {METRICS_TOKEN}"}


def _base_env(var_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        SWITCHYARD_VAR_DIR=str(var_dir),
        PYTHONUNBUFFERED="1",
        LOG_LEVEL="INFO",
        SWITCHYARD_AGENT_STALE_S="30",
        DJANGO_SETTINGS_MODULE="platform_site.settings",
        # Off unless a test asks (start_server's grpc_port): on the default port, parallel
        # test servers would share it through SO_REUSEPORT and answer each other's calls.
        SWITCHYARD_GRPC_PORT="0",
        # /metrics needs a bearer token by default; scrapes here send this one (metrics_auth).
        SWITCHYARD_METRICS_TOKEN=METRICS_TOKEN,
    )
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


# A migrate takes seconds and dozens of backends are made per run: each kind of backend is
# migrated once per test session, and every backend starts from a copy of that database. The
# rows a test needs before it starts (its node, tenants, rollout policy, users) are made once too,
# in a template of their own per seed (STYLE.md 22), so a platform's first request does not wait
# for them; the harness calls that come later run in the backend's one Django process
# (Backend.manage, manage_runner.py), which costs ~1.5 s to start once per backend instead of
# once per call. A seed item stands for the harness call that would otherwise make its rows:
#   ("node", name)                             create_node(backend, name)
#   ("tenant", slug) or ("tenant", slug, rps, burst)   create_tenant(backend, slug, rps, burst)
#   ("weight", slug, percent)                  allow_weight(backend, slug, percent)
#   ("shell", code)                            backend.shell(code)
# and that call then answers what the seed made (once) instead of running the command.
Seed = tuple[tuple[Any, ...], ...]
NO_SEED: Seed = ()
# The `stack` fixture's node and tenants, and platform_with_agent's node.
STACK_SEED: Seed = (("node", "node-1"), ("tenant", "alpha"), ("tenant", "beta"))
AGENT_SEED: Seed = (("node", "n"),)


@dataclass
class _Template:
    ref: str  # the SQLite file, or the PostgreSQL database's name
    var_dir: Path  # where its secret_key was made (copied to each backend)
    seeded: dict[tuple[Any, ...], str]


_templates: dict[tuple[str, Seed], _Template] = {}


def _tenant_args(slug: str, rps: float, burst: int) -> list[str]:
    args = ["--rps", str(rps), "--burst", str(burst), "--owner", f"{slug}-engineer"]
    return ["create_tenant", slug, *args, "--scopes", "predict,deploy", "--json", "--skip-checks"]


def _weight_code(slug: str, percent: float) -> str:
    return (
        "from rollouts.models import RolloutPolicy; from tenants.models import Tenant; "
        f"RolloutPolicy.objects.update_or_create(tenant=Tenant.objects.get(slug={slug!r}), "
        f"model=None, defaults={{'max_weight_without_approval': {percent}}})"
    )


def _seed_key(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """The harness call (with its defaults) that a seeded item stands for."""
    kind = item[0]
    if kind == "tenant":
        rps, burst = item[2:] if len(item) == 4 else (1000, 2000)
        return ("tenant", item[1], float(rps), int(burst))
    if kind == "weight":  # allow_weight is shell code: seeded as that code
        return ("shell", _weight_code(item[1], float(item[2])))
    if kind in ("node", "shell"):
        return (kind, item[1])
    raise ValueError(f"unknown seed item {item!r}")


def _seed_command(item: tuple[Any, ...]) -> list[str]:
    """The management command that makes a seed item's rows (as its harness call would)."""
    key = _seed_key(item)
    if key[0] == "tenant":
        return _tenant_args(key[1], key[2], key[3])
    if key[0] == "node":
        return ["create_node", key[1], "--quiet", "--skip-checks"]
    return ["shell", "-v", "0", "-c", key[1]]


# shell -c prints to the process's stdout, not to call_command's: it is redirected per command.
_SEED_CODE = """
import contextlib, io, json, sys
from django.core.management import call_command
outputs = []
for args in json.loads(sys.argv[-1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        call_command(*args, stdout=out)
    outputs.append(out.getvalue())
print("SEEDED " + json.dumps(outputs))
"""


def _seed(backend: Backend, seed: Seed) -> dict[tuple[Any, ...], str]:
    """Make the seed's rows in one manage.py process; what each harness call would answer."""
    if not seed:
        return {}
    commands = [_seed_command(item) for item in seed]
    code = _SEED_CODE.replace("sys.argv[-1]", repr(json.dumps(commands)))
    out = backend.shell(code)
    outputs = json.loads(out[out.index("SEEDED ") + len("SEEDED ") :])
    answers = {}
    for item, text in zip(seed, outputs, strict=True):
        key = _seed_key(item)
        answers[key] = json.loads(text)["api_key"] if key[0] == "tenant" else text
    return answers


def _copy_sqlite(source: str | Path, target: Path) -> None:
    """A consistent copy of a SQLite database, its -wal file included (the settings put SQLite
    in WAL mode: a copy of the main file alone may miss the last transactions)."""
    src, dst = sqlite3.connect(source), sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


def _from_template(backend: Backend, template: _Template) -> Backend:
    secret = template.var_dir / "secret_key"
    if secret.exists():
        shutil.copyfile(secret, backend.var_dir / "secret_key")
    backend.seeded = dict(template.seeded)
    return backend


def _embedded_template(seed: Seed) -> _Template:
    if ("embedded", seed) not in _templates:
        template_dir = Path(tempfile.mkdtemp(prefix="sy-e2e-template-"))
        atexit.register(shutil.rmtree, template_dir, True)
        backend = Backend("embedded", _base_env(template_dir), template_dir)
        if seed:
            base = _embedded_template(NO_SEED)
            _copy_sqlite(base.ref, template_dir / "switchyard.sqlite3")
            _from_template(backend, base)
        else:
            backend.manage("migrate", "--noinput", "-v0")
        seeded = _seed(backend, seed)
        backend.stop_runner()
        _templates["embedded", seed] = _Template(
            str(template_dir / "switchyard.sqlite3"), template_dir, seeded
        )
    return _templates["embedded", seed]


def embedded_backend(tmp: Path, seed: Seed = NO_SEED) -> Backend:
    """A fresh SQLite database of its own (a copy of one migrated, and seeded, for the
    session)."""
    template = _embedded_template(seed)
    _copy_sqlite(template.ref, tmp / "switchyard.sqlite3")
    return _from_template(Backend("embedded", _base_env(tmp), tmp), template)


def _admin_url() -> str:
    return os.environ["DATABASE_URL"].replace("postgres://", "postgresql://", 1)


def _create_database(template: str | None = None) -> str:
    """A new PostgreSQL database (a copy of ``template`` if given); the caller drops it."""
    import psycopg

    admin_url = _admin_url()
    name = f"sy_e2e_{uuid.uuid4().hex[:10]}"
    copy = f' TEMPLATE "{template}"' if template else ""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{copy}')
    return name


def _drop_database(name: str) -> None:
    import psycopg

    with psycopg.connect(_admin_url(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _database_url(name: str) -> str:
    return f"{_admin_url().rsplit('/', 1)[0]}/{name}"


def _postgres_template(seed: Seed) -> _Template:
    """A PostgreSQL database migrated (and seeded) once for the session, to copy from."""
    if ("services", seed) not in _templates:
        base = _postgres_template(NO_SEED) if seed else None
        name = _create_database(base.ref if base else None)
        atexit.register(_drop_database, name)
        template_dir = Path(tempfile.mkdtemp(prefix="sy-e2e-template-"))
        atexit.register(shutil.rmtree, template_dir, True)
        env = _base_env(template_dir) | {"DATABASE_URL": _database_url(name)}
        backend = Backend("services", env, template_dir)
        if base:
            _from_template(backend, base)
        else:
            backend.manage("migrate", "--noinput", "-v0")
        seeded = _seed(backend, seed)
        backend.stop_runner()
        _templates["services", seed] = _Template(name, template_dir, seeded)
    return _templates["services", seed]


def services_backend(tmp: Path, seed: Seed = NO_SEED) -> Backend:
    """A fresh PostgreSQL database (a copy of one migrated, and seeded, for the session) and a
    flushed Redis database of their own."""
    import redis

    template = _postgres_template(seed)
    name = _create_database(template.ref)
    redis_base = os.environ["REDIS_URL"].rsplit("/", 1)[0]
    db, lock = _hold_redis_db(redis_base)
    redis_url = f"{redis_base}/{db}"
    redis.Redis.from_url(redis_url).flushdb()
    env = _base_env(tmp)
    env.update(DATABASE_URL=_database_url(name), REDIS_URL=redis_url)
    backend = Backend("services", env, tmp)
    backend.cleanup.append(lambda: _drop_database(name))
    backend.cleanup.append(lambda: os.close(lock))  # first (cleanup runs backwards)
    return _from_template(backend, template)


def _hold_redis_db(base_url: str, timeout: float = 300) -> tuple[int, int]:
    """A Redis database number (REDIS_DBS) that no other backend on this machine holds, and
    the file descriptor of its lock: closing it gives the number back."""
    server = urlsplit(base_url)
    locks = Path(tempfile.gettempdir()) / "switchyard-e2e-redis"
    locks.mkdir(exist_ok=True)
    first = next(_redis_turn)
    deadline = time.monotonic() + timeout
    while True:
        for i in range(len(REDIS_DBS)):
            db = REDIS_DBS[(first + i) % len(REDIS_DBS)]
            path = locks / f"{server.hostname}-{server.port or 6379}-{db}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by children
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return db, fd
        if time.monotonic() > deadline:
            raise RuntimeError(f"other backends hold every Redis database {REDIS_DBS}")
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process with its output in a log file, stopped politely then firmly."""

    def __init__(
        self, name: str, args: list[str], env: dict[str, str], log_dir: Path, cwd: Path = ROOT
    ):
        self.name = name
        self.log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            args,
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to say goodbye."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


SERVER_ARGS = {
    "uvicorn": "-m platform_site.serve platform_site.asgi:application "
    "--host 127.0.0.1 --port {port} "
    "--no-access-log --http gateway.http_bounds:BoundedHttpProtocol",
    "daphne": "-m daphne -b 127.0.0.1 -p {port} platform_site.asgi:application",
}


def start_server(backend: Backend, kind: str, port: int, *extra: str, grpc_port: int = 0) -> Proc:
    """uvicorn or daphne on 127.0.0.1:port (and OIP v2 over gRPC on 127.0.0.1:grpc_port when
    one is given); returns once /v2/health/live answers."""
    args = [PY, *SERVER_ARGS[kind].format(port=port).split(), *extra]
    env = dict(backend.env, SWITCHYARD_GRPC_PORT=str(grpc_port), SWITCHYARD_GRPC_HOST="127.0.0.1")
    proc = Proc(kind, args, env, backend.var_dir)
    wait_until(lambda: answers(f"http://127.0.0.1:{port}"), 30, proc)
    return proc


def start_agent(backend: Backend, base_url: str, token: str, name: str = "agent") -> Proc:
    cache = backend.var_dir / f"cache-{name}"
    args = [PY, "-m", "serving_agent", "--platform", base_url, "--token", token]
    return Proc(name, [*args, "--cache-dir", str(cache)], backend.env, backend.var_dir)


def start_celery(backend: Backend, what: str) -> Proc:
    """A Celery worker (solo pool) or beat with its schedule file in the backend's folder."""
    args = [PY, *"-m celery -A platform_site".split(), what, "--loglevel", "INFO"]
    if what == "worker":
        args += ["--pool", "solo"]
    else:
        args += ["--schedule", str(backend.var_dir / "beat-schedule")]
    return Proc(f"celery-{what}", args, backend.env, backend.var_dir)


def answers(base_url: str) -> bool:
    """Whether the platform at base_url answers its liveness probe."""
    try:
        return httpx.get(f"{base_url}/v2/health/live", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(
    check: Callable[[], Any], timeout: float, proc: Proc | None = None, interval: float = 0.1
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log()[-3000:]}")
        time.sleep(interval)
    detail = f"\n{proc.name} log:\n{proc.log()[-3000:]}" if proc else ""
    raise TimeoutError(f"condition not met within {timeout} s{detail}")


def create_tenant(backend: Backend, slug: str, rps: float = 1000, burst: int = 2000) -> str:
    """A tenant and an engineer's key that infers and deploys (the tests upload with it)."""
    seeded = backend.seeded.pop(_seed_key(("tenant", slug, rps, burst)), None)
    if seeded is not None:
        return seeded
    return json.loads(backend.manage(*_tenant_args(slug, rps, burst)))["api_key"]


def create_node(backend: Backend, name: str) -> str:
    seeded = backend.seeded.pop(("node", name), None)
    if seeded is None:
        # --skip-checks: the system checks import every URL configuration and view (~0.5 s).
        seeded = backend.manage(*_seed_command(("node", name)))
    return seeded.strip()


def dispatched(url: str) -> dict[str, float]:
    """This process's requests handed to an agent: {"local": n, "forwarded": m}."""
    text = httpx.get(f"{url}/metrics", headers=metrics_auth(), timeout=10).text
    found = re.findall(r'^switchyard_gateway_dispatched_total\{path="(\w+)"\} (\S+)$', text, re.M)
    counts = {"local": 0.0, "forwarded": 0.0}
    counts.update({path: float(n) for path, n in found})
    return counts


def allow_weight(backend: Backend, slug: str, percent: float) -> None:
    """Let the tenant's canaries carry ``percent`` without approval (the rollout policy's
    default is 10 %): for tests of routing and guardrails, not of approvals."""
    backend.shell(_weight_code(slug, float(percent)))


def run_drill_on(backend_name: str, drill: Callable[[Backend], Any]) -> Any:
    """A bench drill's run: a backend of its own ("embedded" or "services"), in a folder
    removed afterwards, closed whatever the drill does; returns what the drill returns."""
    if backend_name == "services" and not services_available():
        raise SystemExit("--backend services needs DATABASE_URL (PostgreSQL) and REDIS_URL")
    tmp = Path(tempfile.mkdtemp(prefix="sy-drill-"))
    make = services_backend if backend_name == "services" else embedded_backend
    backend = make(tmp)
    try:
        return drill(backend)
    finally:
        backend.close()
        shutil.rmtree(tmp, ignore_errors=True)


def drill_heading(backend_name: str, what: str) -> str:
    """The line above a drill's table: backend, when, which machine, and the load."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"Backend {backend_name}, {when}, {platform.node()} ({os.cpu_count()} CPUs), {what}:\n"
