"""The local backend, the embedded default: agent Deployments as ``python -m serving_agent``
processes on this machine, kept at their desired count like a ReplicaSet keeps its pods.

The state lives on disk rather than in this object because the processes outlive whoever
started them: a Celery worker starts replicas and is recycled, the web server only looks, a
restarted worker must find the fleet again. So every instance over the same ``state_dir`` sees
one fleet::

    state_dir/<name>/spec.json          the applied template and the desired replicas
    state_dir/<name>/replica-<i>.pid    the pid of replica i (its agent is named <name>-<i>)
    state_dir/<name>/replica-<i>.log    its stdout and stderr, appended across restarts
    state_dir/.locks/<name>.lock        flock'd around every change, so callers take turns

A pid file is trusted only while ``/proc/<pid>/cmdline`` still names ``serving_agent`` and the
replica: after a reboot or a crash the number may belong to an unrelated process by now, which
must be neither counted nor signalled.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from platform_site.secret_files import write_private

from .base import AgentTemplate, ClusterError, NotFound, ScaleResult

logger = logging.getLogger(__name__)

# The name becomes a directory, so it must be exactly a DNS-1123 label (no "..", no "/"); names
# starting with a dot are then free for our own entries (.locks, .cache).
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DEPLOYMENT_ENV = "SWITCHYARD_DEPLOYMENT"
LOG_ROTATE_BYTES = 10 * 1024 * 1024  # one old generation is kept, as replica-<i>.log.1
KILL_WAIT_S = 5.0  # after SIGKILL; only a process stuck in the kernel takes longer
_PID_FILE = re.compile(r"^replica-(\d+)\.pid$")

# Every agent this process started, so that its exit is reaped (Popen.poll is waitpid WNOHANG)
# whichever instance looks next: a zombie would otherwise linger until this process exits.
# Module-level because several LocalBackend objects may share one process.
_CHILDREN: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}  # pid -> (replica, process)
# A forked process (a Celery pool worker, a preforked web worker) is not their parent: waitpid
# there would fail and read as "exited", so it must judge them by command line like anyone else.
os.register_at_fork(after_in_child=_CHILDREN.clear)


@dataclass
class Reconciled:
    """What one reconcile did to a deployment; ``error`` is set when a start failed."""

    started: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    error: str = ""


class LocalBackend:
    """Agent processes on this machine, one per replica, started in their own session so that
    they survive the worker that started them and a stop can signal the whole group.

    The processes' command comes from this backend's settings only: the platform URL is
    ``platform_url`` and never ``template.platform_url`` (that one is what pods inside a cluster
    use; local processes reach the platform where the backend says, typically loopback, and
    every caller starts identical replicas). The node token is read by the agents from
    ``token_file``, which the platform writes; ``template.token_secret`` and the
    Kubernetes-only fields (image, resources, node selector, tolerations) are recorded in the
    spec for display and otherwise ignored. As nothing in the template reaches the command, a
    re-apply never restarts running replicas.
    """

    def __init__(
        self,
        state_dir: Path,
        platform_url: str,
        token_file: Path,
        python: str = sys.executable,
        cache_dir: Path | None = None,
        stop_timeout_s: float = 10.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        # Absolute paths: the agents inherit our working directory, which need not stay ours.
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.platform_url = platform_url
        self.token_file = Path(token_file).expanduser().resolve()
        self.python = python
        # One cache for the whole fleet: it is content-addressed and written by rename, so
        # replicas share downloads safely.
        self.cache_dir = (
            Path(cache_dir).expanduser().resolve() if cache_dir else self.state_dir / ".cache"
        )
        self.stop_timeout_s = stop_timeout_s
        self.extra_args = tuple(extra_args)

    # -- the interface -------------------------------------------------------------------

    def apply(self, template: AgentTemplate, dry_run: bool = False) -> dict[str, Any]:
        """Record the template and start its replicas; return the spec as stored.

        As the Kubernetes backend does on replace, an applied deployment keeps its current
        desired replicas (those belong to ``scale``); a new one is recorded at 0 and then
        scaled to ``template.replicas``, so if a replica cannot start, ClusterError is raised
        and the spec stays at 0: the state never claims replicas that could not start."""
        name = template.name
        self._check_name(name)
        if template.replicas < 0:
            raise ValueError("replicas must be at least 0")
        with self._locked(name):
            current = self._read_spec(name)
            now = _now()
            spec: dict[str, Any] = {
                "name": name,
                "desired": current["desired"] if current else 0,
                "template": asdict(template),
                "applied_at": current["applied_at"] if current else now,
                "updated_at": now,
            }
            target = spec["desired"] if current else template.replicas
            if dry_run:
                return {**spec, "desired": target, "created": current is None, "dry_run": True}
            self._write_spec(name, spec)
            self._scale_locked(name, spec, target)
            return {**self._require_spec(name), "created": current is None, "dry_run": False}

    def scale(self, name: str, replicas: int, dry_run: bool = False) -> ScaleResult:
        """Set the desired replicas and converge: start the missing ones (including any that
        died), then stop the extra ones, highest index first.

        If a replica cannot start, the ones this call added are stopped again and ClusterError
        is raised with the recorded desired unchanged. A dry run changes nothing and, as in the
        Kubernetes backend, has ``accepted=None``."""
        if replicas < 0:
            raise ValueError("replicas must be at least 0")
        self._check_name(name)
        with self._locked(name):
            spec = self._read_spec(name)
            if spec is None:
                raise NotFound(f"local deployment {name} was never applied")
            before = int(spec["desired"])
            if dry_run:
                return ScaleResult(
                    name=name,
                    requested=replicas,
                    accepted=None,
                    dry_run=True,
                    changed=before != replicas,
                    detail=f"would scale {before} -> {replicas}"
                    if before != replicas
                    else f"already at {replicas} replicas",
                )
            done = self._scale_locked(name, spec, replicas)
        changes = _describe_changes(done)
        detail = (
            f"scaled {before} -> {replicas}"
            if before != replicas
            else f"already at {replicas} replicas"
        )
        return ScaleResult(
            name=name,
            requested=replicas,
            accepted=replicas,
            dry_run=False,
            changed=before != replicas,
            detail=f"{detail}{changes}",
        )

    def replicas(self, name: str) -> tuple[int, int]:
        """(desired, alive): alive counts every live replica process, including one still being
        stopped by a concurrent scale down. Reads take no lock: files are replaced atomically."""
        spec = self._require_spec(name)
        alive = sum(self._alive(name, i) is not None for i in self._pid_indices(name))
        return int(spec["desired"]), alive

    def delete(self, name: str) -> None:
        """Stop every replica and remove the deployment's directory; a missing one is fine.

        The spec goes first, so a crash halfway leaves a directory without a spec, which
        ``reconcile_all`` finishes deleting instead of restarting its replicas. Raises
        ClusterError only if a replica outlives SIGKILL."""
        self._check_name(name)
        with self._locked(name):
            self._remove_locked(name)

    # -- beyond the interface ------------------------------------------------------------

    def reconcile_all(self) -> dict[str, Reconciled]:
        """Bring every applied deployment back to its desired replicas (restarting those that
        died) and finish interrupted deletes. One deployment's failure does not stop the rest:
        it is reported in its ``Reconciled.error``."""
        report: dict[str, Reconciled] = {}
        if not self.state_dir.is_dir():
            return report
        for entry in sorted(self.state_dir.iterdir()):
            if not entry.is_dir() or not DNS_LABEL.match(entry.name):
                continue
            name = entry.name
            with self._locked(name):
                spec = self._read_spec(name)
                try:
                    if spec is not None:
                        report[name] = self._converge(name, int(spec["desired"]))
                    elif any(entry.glob("replica-*.pid")):  # an interrupted delete
                        report[name] = Reconciled(stopped=self._remove_locked(name))
                except ClusterError as exc:
                    report[name] = Reconciled(error=str(exc))
                    logger.warning("reconcile of %s failed: %s", name, exc)
        return report

    def stop_all(self) -> list[str]:
        """Stop every replica's process but keep the specs, as when the machine shuts down:
        the next ``reconcile_all`` starts them again at their desired counts. Returns the
        names of the deployments whose replicas were stopped."""
        stopped: list[str] = []
        if not self.state_dir.is_dir():
            return stopped
        for entry in sorted(self.state_dir.iterdir()):
            if entry.is_dir() and DNS_LABEL.match(entry.name):
                with self._locked(entry.name):
                    if self._stop(entry.name, sorted(self._pid_indices(entry.name), reverse=True)):
                        stopped.append(entry.name)
        return stopped

    def describe(self, name: str) -> dict[str, Any]:
        """The spec and one entry per replica (pid, alive, started_at, log; ``wanted`` is
        False for one above the desired count, still being stopped) for the UI; raises
        NotFound if the deployment was never applied."""
        spec = self._require_spec(name)
        desired = int(spec["desired"])
        rows = []
        for i in sorted(set(range(desired)) | set(self._pid_indices(name))):
            pid_file = self._pid_file(name, i)
            pid = _read_pid(pid_file)
            started_at = None
            if pid is not None:
                try:
                    mtime = pid_file.stat().st_mtime
                    started_at = datetime.fromtimestamp(mtime, UTC).isoformat()
                except OSError:
                    pass  # stopped meanwhile
            rows.append(
                {
                    "index": i,
                    "name": _replica(name, i),
                    "pid": pid,
                    "alive": self._alive(name, i) is not None,
                    "started_at": started_at,
                    "log": str(self._dir(name) / f"replica-{i}.log"),
                    "wanted": i < desired,
                }
            )
        return {
            **spec,
            "platform_url": self.platform_url,
            "alive": sum(row["alive"] for row in rows),
            "replicas": rows,
        }

    # -- converging ----------------------------------------------------------------------

    def _scale_locked(self, name: str, spec: dict[str, Any], replicas: int) -> Reconciled:
        """Converge to ``replicas`` and only then record it (the lock is held)."""
        before = int(spec["desired"])
        try:
            done = self._converge(name, replicas)
        except ClusterError:
            # Keep the fleet where the recorded desired says: stop what this call added above it.
            self._stop(name, [i for i in self._pid_indices(name) if i >= before])
            raise
        if replicas != before:
            self._write_spec(name, {**spec, "desired": replicas, "updated_at": _now()})
        return done

    def _converge(self, name: str, desired: int) -> Reconciled:
        """Start every missing replica below ``desired``, then stop every one at or above it.

        Starting first means a failure leaves nothing stopped: the caller can raise with the
        fleet intact."""
        done = Reconciled()
        for i in range(desired):
            if self._alive(name, i) is None:
                self._start(name, i)  # raises ClusterError; the caller decides what to undo
                done.started.append(i)
        extra = sorted((i for i in self._pid_indices(name) if i >= desired), reverse=True)
        done.stopped = self._stop(name, extra)
        return done

    def _start(self, name: str, index: int) -> int:
        replica = _replica(name, index)
        if not self.token_file.is_file():
            # The agent would exit at once; saying so here beats a crash loop in the logs.
            raise ClusterError(f"cannot start {replica}: no token file at {self.token_file}")
        directory = self._dir(name)
        directory.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.python,
            "-m",
            "serving_agent",
            "--platform",
            self.platform_url,
            "--token-file",
            str(self.token_file),
            "--name",
            replica,
            "--cache-dir",
            str(self.cache_dir),
            *self.extra_args,
        ]
        # The deployment goes by environment: older agents ignore it, newer ones report it.
        env = {**os.environ, DEPLOYMENT_ENV: name}
        log = directory / f"replica-{index}.log"
        _rotate(log)
        try:
            with open(log, "ab") as out:
                out.write(f"--- {_now()} starting {replica}\n".encode())
                out.flush()
                # A new session: a signal to the worker's process group (Ctrl-C, a Celery
                # warm shutdown) does not reach the agents, and a stop can signal the agent's
                # own group. close_fds (the default) keeps our lock fd out of the child.
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        except OSError as exc:
            raise ClusterError(f"cannot start {replica}: {exc}") from exc
        _CHILDREN[proc.pid] = (replica, proc)
        try:
            write_private(self._pid_file(name, index), f"{proc.pid}\n")
        except OSError as exc:
            proc.kill()  # an untracked process is one nobody would ever stop
            proc.wait()
            raise ClusterError(f"cannot record the pid of {replica}: {exc}") from exc
        logger.info("started %s (pid %d)", replica, proc.pid)
        return proc.pid

    def _stop(self, name: str, indices: Sequence[int]) -> list[int]:
        """SIGTERM the given replicas all at once, SIGKILL those still there after
        ``stop_timeout_s``; return the indices whose process was stopped. A pid file whose
        process is no longer our agent is dropped without signalling anything."""
        pending: dict[int, int] = {}
        for i in indices:
            pid = self._alive(name, i)
            if pid is None:
                self._pid_file(name, i).unlink(missing_ok=True)
            else:
                _signal_group(pid, signal.SIGTERM)
                pending[i] = pid
        stuck = self._wait_gone(name, pending, self.stop_timeout_s)
        for i in stuck:
            logger.warning(
                "%s ignored SIGTERM for %.0f s; killing", _replica(name, i), self.stop_timeout_s
            )
            _signal_group(pending[i], signal.SIGKILL)
        stuck = self._wait_gone(name, {i: pending[i] for i in stuck}, KILL_WAIT_S)
        for i in pending:
            if i not in stuck:
                self._pid_file(name, i).unlink(missing_ok=True)
        # Left with its pid file, a process that survived SIGKILL is retried by a later stop.
        return [i for i in pending if i not in stuck]

    def _wait_gone(self, name: str, pending: dict[int, int], timeout_s: float) -> list[int]:
        """Poll until none of ``pending`` (index -> pid) is alive or the time is up; return the
        indices still alive."""
        deadline = time.monotonic() + timeout_s
        left = dict(pending)
        while left:
            left = {i: pid for i, pid in left.items() if _is_agent(pid, _replica(name, i))}
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return sorted(left)

    def _remove_locked(self, name: str) -> list[int]:
        directory = self._dir(name)
        if not directory.exists():
            return []
        (directory / "spec.json").unlink(missing_ok=True)
        stopped = self._stop(name, sorted(self._pid_indices(name), reverse=True))
        if self._pid_indices(name):
            # A process survived SIGKILL: keep its pid file so a later reconcile_all retries.
            raise ClusterError(f"local deployment {name}: some replicas would not stop")
        shutil.rmtree(directory, ignore_errors=True)
        return stopped

    # -- state on disk -------------------------------------------------------------------

    def _alive(self, name: str, index: int) -> int | None:
        """The pid of replica ``index`` if that process is alive and still our agent."""
        pid = _read_pid(self._pid_file(name, index))
        if pid is None or not _is_agent(pid, _replica(name, index)):
            return None
        return pid

    @contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        # flock on a fresh open file: it excludes other processes and other threads alike.
        # Lock files are never removed, as unlinking one could let two callers hold "the" lock.
        locks = self.state_dir / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{name}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _check_name(self, name: str) -> None:
        if not DNS_LABEL.match(name):
            raise ValueError(f"{name!r} is not a DNS-1123 label (a-z, 0-9, '-', at most 63)")

    def _dir(self, name: str) -> Path:
        self._check_name(name)
        return self.state_dir / name

    def _pid_file(self, name: str, index: int) -> Path:
        return self._dir(name) / f"replica-{index}.pid"

    def _pid_indices(self, name: str) -> list[int]:
        try:
            names = os.listdir(self._dir(name))
        except FileNotFoundError:
            return []
        return [int(m.group(1)) for n in names if (m := _PID_FILE.match(n))]

    def _read_spec(self, name: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads((self._dir(name) / "spec.json").read_text())
        except FileNotFoundError:
            return None
        return data

    def _require_spec(self, name: str) -> dict[str, Any]:
        spec = self._read_spec(name)
        if spec is None:
            raise NotFound(f"local deployment {name} was never applied")
        return spec

    def _write_spec(self, name: str, spec: dict[str, Any]) -> None:
        directory = self._dir(name)
        directory.mkdir(parents=True, exist_ok=True)
        write_private(directory / "spec.json", json.dumps(spec, indent=2, sort_keys=True))


def _replica(name: str, index: int) -> str:
    """The agent's node name; unambiguous, since a deployment's replicas all end in -<digits>."""
    return f"{name}-{index}"


def _is_agent(pid: int, replica: str) -> bool:
    """Whether ``pid`` is a live ``serving_agent`` named ``replica``.

    A child of ours is judged by waitpid alone (Popen.poll, which also reaps it): until it is
    reaped its number cannot be reused, and its command line reads empty both while it execs
    and while it exits. Any other process is judged by its command line."""
    child = _CHILDREN.get(pid)
    if child is not None:
        if child[1].poll() is None:
            return child[0] == replica
        _CHILDREN.pop(pid, None)
        return False
    args = _cmdline(pid)
    return "serving_agent" in args and replica in args


def _cmdline(pid: int) -> list[str]:
    """The process's arguments, or [] if it is gone, a zombie or not a user process."""
    proc = Path("/proc")
    if not proc.is_dir():
        return _cmdline_from_ps(pid)
    for _ in range(5):
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes()
            state = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return []
        if raw:
            return raw.decode(errors="replace").split("\0")
        if state in ("Z", "X"):
            return []
        # Empty but running: caught between exec's start and the new arguments being mapped
        # (a process another worker just started), or a kernel thread. Look again shortly.
        time.sleep(0.01)
    return []


def _cmdline_from_ps(pid: int) -> list[str]:
    # No /proc (macOS, for a developer's laptop): ps prints the arguments joined by spaces,
    # which is enough to find the two we look for, neither of which may contain one.
    try:
        out = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the agent and anything it started: it leads its own process group."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass  # exited meanwhile


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None  # missing, or torn by a crash: treat as no process


def _rotate(log: Path) -> None:
    try:
        if log.stat().st_size > LOG_ROTATE_BYTES:
            os.replace(log, log.with_name(log.name + ".1"))
    except FileNotFoundError:
        pass


def _describe_changes(done: Reconciled) -> str:
    parts = []
    if done.started:
        parts.append("started " + ", ".join(map(str, done.started)))
    if done.stopped:
        parts.append("stopped " + ", ".join(map(str, done.stopped)))
    return f" ({'; '.join(parts)})" if parts else ""


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
