"""The supervision fault drill: the platform's processes under supervisord with the config
`make up` uses (deploy/supervisord.conf), a bounded load of OIP v2 infer requests, and each of
the agent, the Celery worker and beat SIGKILLed in turn. Shared by tests/e2e/test_supervision.py
(which asserts on it) and bench/drill_supervision.py (which prints its table).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import xmlrpc.client
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from supervisor.xmlrpc import SupervisorTransport

from tests.onnx_models import small_onnx

from .harness import (
    PY,
    ROOT,
    Backend,
    Proc,
    answers,
    create_node,
    create_tenant,
    free_port,
    start_agent,
    wait_until,
)

CONF = ROOT / "deploy" / "supervisord.conf"
PROGRAMS = ("web", "worker", "beat", "agent")
KILLED = ("agent", "worker", "beat")  # in this order: the worker's check needs beat
CONCURRENCY = 4  # load threads, so at most this many requests are in flight at a kill
PAUSE_S = 0.02  # between one thread's requests: a steady load that leaves CPU for restarts
STEADY_S = 3.0  # load watched after each recovery (and before the first kill)
# The rows run_drill needs (make_backend's seed): its tenant and the two agents' nodes.
DRILL_SEED = (("tenant", "drill"), ("node", "supervised"), ("node", "spare"))
INFER_BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.5] * 4}]}


class Supervised:
    """supervisord in the foreground with deploy/supervisord.conf, for one backend, as
    scripts/up.sh runs it; programs are inspected and PIDs read over its XML-RPC socket."""

    def __init__(self, backend: Backend, port: int, web_workers: int = 1):
        # The variables the config expands (%(ENV_X)s), as scripts/up.sh exports them.
        env = dict(backend.env, PY=PY, SWITCHYARD_PORT=str(port), WEB_WORKERS=str(web_workers))
        socket_url = f"unix://{backend.var_dir}/supervisor.sock"
        args = [PY, "-m", "supervisor.supervisord", "-c", str(CONF)]
        self.proc = Proc("supervisord", args, env, backend.var_dir)
        self.rpc: Any = xmlrpc.client.ServerProxy(
            "http://127.0.0.1", transport=SupervisorTransport(None, None, socket_url)
        )

    def info(self, name: str) -> dict[str, Any]:
        info: dict[str, Any] = self.rpc.supervisor.getProcessInfo(name)
        return info

    def running(self, name: str) -> dict[str, Any] | None:
        info = self.info(name)
        return info if info["statename"] == "RUNNING" else None

    def stop(self) -> None:
        """SIGTERM to supervisord, which stops every program (as Ctrl-C does under make up).
        If it has not within a minute, the programs it still runs are killed, then it."""
        popen = self.proc.popen
        if popen.poll() is None:
            os.kill(popen.pid, signal.SIGTERM)
            try:
                popen.wait(60)
            except subprocess.TimeoutExpired:
                for name in PROGRAMS:
                    try:
                        pid = self.info(name)["pid"]
                        if pid:  # each program runs in a process group of its own
                            os.killpg(pid, signal.SIGKILL)
                    except (OSError, xmlrpc.client.Error):
                        pass
                popen.kill()
        self.proc.stop()


@dataclass
class Outcome:
    started: float
    status: int  # 0: no HTTP answer at all (connection refused or reset, timeout)


@dataclass
class Load:
    """CONCURRENCY threads sending OIP v2 infer requests until stopped, each outcome kept."""

    url: str
    key: str
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(CONCURRENCY):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=10) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    status = client.post("/v2/models/clf/infer", json=INFER_BODY).status_code
                except httpx.HTTPError:
                    status = 0
                self.outcomes.append(Outcome(started, status))  # list.append is atomic
                time.sleep(PAUSE_S)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)

    def between(self, start: float, end: float) -> list[Outcome]:
        return [o for o in list(self.outcomes) if start <= o.started < end]


@dataclass
class Row:
    """One kill: what was broken, the requests started from the kill to the recovery, and how
    those started in the steady period after it fared."""

    broken: str
    sent: int
    failed: int
    lost: int
    restart_s: float  # until supervisord ran a new process (RUNNING: up for startsecs)
    recover_s: float
    after_sent: int
    after_failed: int
    restarted: list[str]  # programs whose PID changed: only the one killed
    degraded: int = 0  # no fallback version is configured in this drill


def _live_sessions(backend: Backend) -> dict[str, int]:
    """Node name -> id of its newest connected agent session that has a version ready."""
    rows = backend.query(
        "SELECT n.name, s.id, s.ready_versions FROM gateway_agentsession s "
        "JOIN gateway_node n ON n.id = s.node_id WHERE s.disconnected_at IS NULL"
    )
    found: dict[str, int] = {}
    for name, session_id, ready in rows:
        versions = json.loads(ready) if isinstance(ready, str) else ready
        if versions:
            found[name] = max(found.get(name, 0), session_id)
    return found


def _log_size(proc: Proc) -> int:
    return proc.log_path.stat().st_size


def _logged_since(proc: Proc, offset: int, first: str, then: str) -> bool:
    """Whether supervisord's output after offset has ``first`` (the new process's start-up
    line), and ``then`` after it: a line the killed process left in its pipe does not count."""
    with open(proc.log_path, "rb") as log:
        log.seek(offset)
        text = log.read()
    start = text.find(first.encode())
    return start >= 0 and text.find(then.encode(), start) >= 0


def run_drill(
    backend: Backend, say: Callable[[str], None] = lambda _: None, steady_s: float = STEADY_S
) -> list[Row]:
    """Start the platform under supervision with a spare agent (a second replica outside it),
    load it, SIGKILL the agent, the worker and beat in turn, and measure each recovery (and
    ``steady_s`` of load after each)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    key = create_tenant(backend, "drill")
    (backend.var_dir / "node-token").write_text(create_node(backend, "supervised"))
    spare_token = create_node(backend, "spare")
    supervised = Supervised(backend, port)
    spare: Proc | None = None
    load = Load(url, key)
    try:
        wait_until(lambda: answers(url), 90, supervised.proc)
        wait_until(lambda: all(supervised.running(p) for p in PROGRAMS), 60, supervised.proc)
        spare = start_agent(backend, url, spare_token, "agent-spare")
        _serve_model(url, key)
        wait_until(lambda: len(_live_sessions(backend)) == 2, 90, supervised.proc, interval=0.5)
        say("platform up under supervisord, model ready on both agents")
        load.start()
        time.sleep(steady_s)
        web = supervised.info("web")
        rows = [_kill_and_recover(backend, supervised, load, name, steady_s) for name in KILLED]
        for row in rows:
            say(f"{row.broken}: recovered in {row.recover_s:.1f} s")
        web_after = supervised.info("web")
        if (web_after["pid"], web_after["start"]) != (web["pid"], web["start"]):
            raise AssertionError("the web process was restarted")
        return rows
    finally:
        load.stop()
        if spare is not None:
            spare.stop()
        supervised.stop()


def _serve_model(url: str, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        created = client.post("/api/v1/models", json={"name": "clf", "task": "classifier"})
        assert created.status_code == 201, created.text
        files = {"artifact": ("model.onnx", small_onnx(), "application/octet-stream")}
        version = client.post("/api/v1/models/clf/versions", files=files)
        assert version.status_code == 201, version.text
        number = version.json()["version"]
        moved = client.put("/api/v1/models/clf/aliases/production", json={"version": number})
        assert moved.status_code == 200, moved.text


def _kill_and_recover(
    backend: Backend, supervised: Supervised, load: Load, name: str, steady_s: float
) -> Row:
    """SIGKILL one program's process; recovered once supervisord runs a new one and it does its
    job again: the agent serves the model again (a new session with it ready), the worker
    runs a task beat sent, beat sends a due task."""
    before = {p: supervised.info(p)["pid"] for p in PROGRAMS}
    sessions = _live_sessions(backend)
    offset = _log_size(supervised.proc)
    killed_at = time.monotonic()
    os.kill(before[name], signal.SIGKILL)
    wait_until(
        lambda: (info := supervised.running(name)) is not None and info["pid"] != before[name],
        60,
        supervised.proc,
    )
    running_at = time.monotonic()
    does_its_job: Callable[[], bool] = {
        "agent": lambda: _live_sessions(backend).get("supervised", 0) > sessions["supervised"],
        "worker": lambda: _logged_since(supervised.proc, offset, "celery@", "] succeeded in"),
        "beat": lambda: _logged_since(
            supervised.proc, offset, "beat: Starting", "Scheduler: Sending due task"
        ),
    }[name]
    wait_until(does_its_job, 90, supervised.proc, interval=0.2)
    recovered_at = time.monotonic()
    time.sleep(steady_s)
    during = load.between(killed_at, recovered_at)
    after = load.between(recovered_at, time.monotonic())
    after_pids = {p: supervised.info(p)["pid"] for p in PROGRAMS}
    return Row(
        broken=name,
        sent=len(during),
        failed=sum(o.status != 200 for o in during),
        lost=sum(o.status == 0 for o in during),
        restart_s=running_at - killed_at,
        recover_s=recovered_at - killed_at,
        after_sent=len(after),
        after_failed=sum(o.status != 200 for o in after),
        restarted=[p for p in PROGRAMS if after_pids[p] != before[p]],
    )


def table(rows: list[Row]) -> str:
    lines = [
        "| process killed (SIGKILL) | requests sent | failed | degraded | lost | running "
        "again (s) | time to recover (s) | sent after recovery | failed after recovery "
        "| restarted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.broken} | {r.sent} | {r.failed} | {r.degraded} | {r.lost} | "
            f"{r.restart_s:.1f} | {r.recover_s:.1f} | {r.after_sent} | {r.after_failed} | "
            f"{', '.join(r.restarted)} |"
        )
    return "\n".join(lines)
