"""Fault drill: a process dies under `make up`'s supervision (deploy/supervisord.conf). Each of
the agent, the Celery worker and beat is SIGKILLed in turn under load: supervisord starts a new
one that does its job again, nothing else is restarted, and only requests in flight on the dead
agent fail. And the heartbeat files the Kubernetes probes of the worker, beat and agents read."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from .conftest import make_backend
from .harness import (
    PY,
    ROOT,
    create_node,
    free_port,
    start_agent,
    start_celery,
    start_server,
    wait_until,
)
from .supervision_drill import CONCURRENCY, run_drill

pytestmark = [pytest.mark.e2e, pytest.mark.serial]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_each_dead_process_comes_back_alone_and_the_platform_keeps_serving(backend_name, tmp_path):
    backend = make_backend(backend_name, tmp_path)
    try:
        # 1.5 s of load after each recovery (the bench watches 3 s): at 4 threads that is still
        # well over a hundred requests that must all be answered 200.
        rows = {row.broken: row for row in run_drill(backend, steady_s=1.5)}
    finally:
        backend.close()
    assert list(rows) == ["agent", "worker", "beat"]
    for name, row in rows.items():
        # Only the killed program got a new PID (run_drill also checks the web's start time).
        assert row.restarted == [name], row
        assert row.sent > 0 and row.after_sent > 0, row  # the load ran throughout
        # Every request got an HTTP answer, and once recovered every answer is a 200.
        assert row.lost == 0 and row.after_failed == 0, row
    # The spare agent took the load: only the requests in flight on the killed agent failed.
    assert rows["agent"].failed <= CONCURRENCY, rows["agent"]
    # The worker and beat are not on the data path: their death costs no request at all.
    assert rows["worker"].failed == 0 and rows["beat"].failed == 0, rows


def _probe(path, *flags: str) -> subprocess.CompletedProcess:
    # The command the Kubernetes probes run (deploy/*.yaml), with the repository's path.
    args = [PY, str(ROOT / "scripts" / "probe_alive.py"), str(path), *flags]
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def test_heartbeat_files_tell_alive_from_ready_and_go_stale_when_wedged(tmp_path):
    """The worker, beat and the agent, each with SWITCHYARD_ALIVE_FILE: all three become ready;
    the agent whose platform is gone is alive but not ready; a beat frozen with SIGSTOP (as a
    wedged process) fails its liveness probe."""
    backend = make_backend("embedded", tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    files = {name: tmp_path / f"alive-{name}" for name in ("worker", "beat", "agent")}
    server = start_server(backend, "uvicorn", port)
    procs = [server]
    try:
        token = create_node(backend, "n")
        for name in ("worker", "beat"):
            backend.env["SWITCHYARD_ALIVE_FILE"] = str(files[name])
            procs.append(start_celery(backend, name))
        backend.env["SWITCHYARD_ALIVE_FILE"] = str(files["agent"])
        procs.append(start_agent(backend, url, token))
        for path in files.values():
            wait_until(lambda p=path: _probe(p, "--ready").returncode == 0, 90, procs[-1])
        # The platform goes away: the agent keeps beating (alive) but cannot serve (not ready).
        server.stop()
        wait_until(lambda: _probe(files["agent"], "--ready").returncode == 1, 30)
        refused = _probe(files["agent"], "--ready")
        assert "not connected to the platform" in refused.stderr
        assert _probe(files["agent"], "--max-age", "20").returncode == 0
        # A frozen beat stops refreshing its file: past the age limit liveness fails.
        beat = procs[2]
        os.kill(beat.popen.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: _probe(files["beat"], "--max-age", "8").returncode == 1, 30)
            assert "wedged" in _probe(files["beat"], "--max-age", "8").stderr
            assert _probe(files["worker"], "--max-age", "20", "--ready").returncode == 0
        finally:
            os.kill(beat.popen.pid, signal.SIGCONT)
    finally:
        for proc in reversed(procs):
            proc.stop()
        backend.close()
