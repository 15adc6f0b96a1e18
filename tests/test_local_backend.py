"""The local backend, starting and stopping real ``serving_agent`` processes.

The agents point at a port nothing listens on, so they keep retrying the connection and stay
up until stopped; no database is needed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.cluster import AgentTemplate, ClusterError, NotFound
from fleet.cluster.local import LocalBackend

PLATFORM = "http://127.0.0.1:9"  # the discard port: connections are refused
NAME = "sy-agent-7-v1"
STOP_TIMEOUT_S = 5.0


def make_template(**overrides: Any) -> AgentTemplate:
    fields: dict[str, Any] = {
        "name": NAME,
        "namespace": "local",
        "image": "unused-locally",
        "platform_url": "https://switchyard.example",  # the backend's URL wins
        "token_secret": "unused-locally",
        "replicas": 0,
    }
    return AgentTemplate(**(fields | overrides))


def cmdline(pid: int) -> list[str]:
    """Its arguments; a process just started may show none for a moment (mid-exec)."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return []
        if raw or zombie or time.monotonic() > deadline:
            return raw.decode().split("\0")
        time.sleep(0.01)


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def is_agent(pid: int) -> bool:
    return "serving_agent" in cmdline(pid)


def wait_until(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def pids(backend: LocalBackend, name: str = NAME) -> dict[int, int | None]:
    return {row["index"]: row["pid"] for row in backend.describe(name)["replicas"]}


def log_of(backend: LocalBackend, index: int, name: str = NAME) -> Path:
    return backend.state_dir / name / f"replica-{index}.log"


def wait_serving(backend: LocalBackend, index: int) -> None:
    """Until the agent has its signal handlers and is retrying the platform."""
    wait_until(lambda: "cannot reach" in log_of(backend, index).read_text())


def kill_leftovers(state: Path) -> None:
    """SIGKILL every agent this test left: those in pid files and any child of ours."""
    found = set()
    for pid_file in state.glob("*/replica-*.pid"):
        try:
            found.add(int(pid_file.read_text()))
        except (OSError, ValueError):
            pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    for pid in found:
        if pid != os.getpid() and is_agent(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # not our child, or reaped already


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    yield state
    kill_leftovers(state)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "node-token"
    path.write_text("syn_0a1b2c3d_" + "x" * 43 + "\n")
    return path


@pytest.fixture
def backend(state_dir: Path, token_file: Path) -> LocalBackend:
    return LocalBackend(state_dir, PLATFORM, token_file, stop_timeout_s=STOP_TIMEOUT_S)


def test_scaling_up_starts_one_agent_process_per_replica(backend: LocalBackend) -> None:
    backend.apply(make_template())
    assert backend.replicas(NAME) == (0, 0)

    result = backend.scale(NAME, 2)

    assert (result.accepted, result.changed, result.dry_run) == (2, True, False)
    assert backend.replicas(NAME) == (2, 2)
    for index, pid in pids(backend).items():
        assert pid is not None
        args = cmdline(pid)
        assert args[args.index("-m") + 1] == "serving_agent"
        assert args[args.index("--name") + 1] == f"{NAME}-{index}"
        assert args[args.index("--platform") + 1] == PLATFORM
        assert args[args.index("--token-file") + 1] == str(backend.token_file)
        assert environ(pid)["SWITCHYARD_DEPLOYMENT"] == NAME
        assert os.getpgid(pid) == pid  # its own session, so it outlives a worker's group


def test_scaling_down_stops_the_highest_replica_with_sigterm(backend: LocalBackend) -> None:
    backend.apply(make_template(replicas=2))
    wait_serving(backend, 0)
    wait_serving(backend, 1)
    before = pids(backend)

    started = time.monotonic()
    result = backend.scale(NAME, 1)

    assert time.monotonic() - started < STOP_TIMEOUT_S  # no SIGKILL needed
    assert (result.accepted, result.changed) == (1, True)
    assert "stopped 1" in result.detail
    assert pids(backend) == {0: before[0]}
    assert not is_agent(before[1] or 0)
    assert ": stopped" in log_of(backend, 1).read_text()  # its clean-shutdown line
    assert not (backend.state_dir / NAME / "replica-1.pid").exists()
    assert backend.replicas(NAME) == (1, 1)


def test_a_killed_replica_is_restarted_by_reconcile_and_by_scale(
    backend: LocalBackend,
) -> None:
    backend.apply(make_template(replicas=1))
    first = pids(backend)[0]
    assert first is not None

    os.kill(first, signal.SIGKILL)
    wait_until(lambda: backend.replicas(NAME) == (1, 0))
    assert not Path(f"/proc/{first}").exists()  # reaped, not left a zombie

    report = backend.reconcile_all()
    assert (report[NAME].started, report[NAME].error) == ([0], "")
    second = pids(backend)[0]
    assert second not in (None, first) and is_agent(second or 0)

    os.kill(second or 0, signal.SIGKILL)
    wait_until(lambda: backend.replicas(NAME) == (1, 0))
    result = backend.scale(NAME, 1)
    assert (result.accepted, result.changed) == (1, False)
    assert "started 0" in result.detail
    assert backend.replicas(NAME) == (1, 1)


def test_a_dry_run_changes_nothing_and_says_whether_it_would(backend: LocalBackend) -> None:
    would_create = backend.apply(make_template(replicas=2), dry_run=True)
    assert (would_create["created"], would_create["desired"]) == (True, 2)
    with pytest.raises(NotFound):
        backend.replicas(NAME)

    backend.apply(make_template())
    would = backend.scale(NAME, 2, dry_run=True)
    same = backend.scale(NAME, 0, dry_run=True)

    assert (would.accepted, would.changed, would.dry_run) == (None, True, True)
    assert (same.accepted, same.changed) == (None, False)
    assert backend.replicas(NAME) == (0, 0)
    assert not list((backend.state_dir / NAME).glob("replica-*"))


def test_a_deployment_never_applied_is_not_found(backend: LocalBackend) -> None:
    with pytest.raises(NotFound):
        backend.scale(NAME, 1)
    with pytest.raises(NotFound):
        backend.replicas(NAME)
    with pytest.raises(NotFound):
        backend.describe(NAME)
    backend.delete(NAME)  # a missing one is not an error


def test_reapplying_keeps_the_desired_replicas_and_records_the_template(
    backend: LocalBackend,
) -> None:
    backend.apply(make_template())

    updated = backend.apply(make_template(replicas=3, image="changed"))

    assert (updated["created"], updated["desired"]) == (False, 0)
    assert updated["template"]["image"] == "changed"
    assert backend.replicas(NAME) == (0, 0)


def test_a_process_that_cannot_start_raises_and_keeps_the_desired_replicas(
    backend: LocalBackend, state_dir: Path, token_file: Path
) -> None:
    backend.apply(make_template(replicas=1))
    broken = LocalBackend(state_dir, PLATFORM, token_file, python="/nonexistent/python")

    with pytest.raises(ClusterError, match="cannot start"):
        broken.scale(NAME, 3)

    assert backend.replicas(NAME) == (1, 1)  # recorded desired and the running one untouched
    with pytest.raises(ClusterError):
        broken.apply(make_template(name="sy-agent-8-v1", replicas=2))
    assert broken.replicas("sy-agent-8-v1") == (0, 0)  # created, but at 0


def test_a_missing_token_file_raises_before_starting_anything(
    state_dir: Path, tmp_path: Path
) -> None:
    backend = LocalBackend(state_dir, PLATFORM, tmp_path / "absent")
    backend.apply(make_template())

    with pytest.raises(ClusterError, match="token file"):
        backend.scale(NAME, 1)
    assert backend.replicas(NAME) == (0, 0)


def test_a_second_backend_on_the_same_directory_sees_the_same_fleet(
    backend: LocalBackend, state_dir: Path, token_file: Path
) -> None:
    backend.apply(make_template(replicas=2))
    other = LocalBackend(state_dir, PLATFORM, token_file, stop_timeout_s=STOP_TIMEOUT_S)

    assert other.replicas(NAME) == (2, 2)
    assert pids(other) == pids(backend)

    other.scale(NAME, 1)
    assert backend.replicas(NAME) == (1, 1)


def test_another_process_sees_the_fleet_and_can_stop_it(
    backend: LocalBackend, state_dir: Path, token_file: Path
) -> None:
    """As a restarted worker would: the agent is not its child, so only the pid file and the
    command line tell it apart."""
    backend.apply(make_template(replicas=1))
    script = (
        "import sys; from pathlib import Path; from fleet.cluster.local import LocalBackend\n"
        "b = LocalBackend(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))\n"
        "print(b.replicas(sys.argv[4])); b.scale(sys.argv[4], 0); print(b.replicas(sys.argv[4]))"
    )
    args = [str(state_dir), PLATFORM, str(token_file), NAME]

    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=30
    )

    assert out.stdout.split("\n")[:2] == ["(1, 1)", "(0, 0)"], out.stderr
    assert backend.replicas(NAME) == (0, 0)


def test_a_forked_worker_does_not_take_its_parents_agents_for_dead(
    backend: LocalBackend,
) -> None:
    """As a Celery pool process forked after the parent started agents: waitpid fails there."""
    backend.apply(make_template(replicas=1))
    read, write = os.pipe()

    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, skipping pytest's teardown
        try:
            os.write(write, repr(backend.replicas(NAME)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        assert f.read() == "(1, 1)"


def test_a_pid_file_of_an_unrelated_process_is_neither_counted_nor_signalled(
    backend: LocalBackend,
) -> None:
    backend.apply(make_template())
    directory = backend.state_dir / NAME
    (directory / "replica-0.pid").write_text(f"{os.getpid()}\n")  # this test: alive, no agent
    (directory / "replica-1.pid").write_text("not a pid\n")

    assert backend.replicas(NAME) == (0, 0)
    assert [row["alive"] for row in backend.describe(NAME)["replicas"]] == [False, False]
    assert backend.reconcile_all()[NAME].stopped == []  # we are still here to check
    assert not list(directory.glob("*.pid"))

    (directory / "replica-0.pid").write_text(f"{os.getpid()}\n")
    backend.scale(NAME, 1)
    assert pids(backend)[0] not in (None, os.getpid())
    assert backend.replicas(NAME) == (1, 1)


def test_delete_stops_every_replica_and_removes_its_state(backend: LocalBackend) -> None:
    backend.apply(make_template(replicas=2))
    running = list(pids(backend).values())

    backend.delete(NAME)

    assert not any(is_agent(pid or 0) for pid in running)
    assert not (backend.state_dir / NAME).exists()
    with pytest.raises(NotFound):
        backend.replicas(NAME)


def test_reconcile_finishes_a_delete_that_was_interrupted(backend: LocalBackend) -> None:
    backend.apply(make_template(replicas=1))
    pid = pids(backend)[0]
    (backend.state_dir / NAME / "spec.json").unlink()  # as if delete crashed right after

    report = backend.reconcile_all()

    assert report[NAME].stopped == [0]
    assert not is_agent(pid or 0)
    assert not (backend.state_dir / NAME).exists()


def test_stop_all_stops_the_processes_and_keeps_the_specs(
    backend: LocalBackend, state_dir: Path, token_file: Path
) -> None:
    backend.apply(make_template())
    backend.scale(NAME, 2)
    # Another process (the `make up` exit trap) stops them.
    other = LocalBackend(state_dir, PLATFORM, token_file)
    assert other.stop_all() == [NAME]
    assert all(pid is None for pid in pids(backend).values())
    assert backend.replicas(NAME) == (2, 0)
    # The next control-loop pass starts them again.
    backend.reconcile_all()
    assert backend.replicas(NAME) == (2, 2)
