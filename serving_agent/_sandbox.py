"""The sandbox a ``python`` package's worker runs in, built from the tools made for it:
bubblewrap (Flatpak's sandbox) for namespaces and the file system, ``setpriv`` to drop to an
unprivileged uid, ``prlimit`` for resource limits, and cgroups for memory, processes and CPU.

What the worker sees: the system's ``/usr`` and ``/etc`` read-only, the Python it runs on, its
environment and its package read-only, a fresh ``/tmp`` and its own scratch folder writable;
nothing else of the node (not the artifact cache, not the agent's token, not other packages).
It has no network unless the version's policy allows it (an empty network namespace), its own
process namespace (it cannot see or signal the agent), runs as a uid of its tenant's own with no
capabilities, and cannot fork past its cgroup's process limit or use more than its memory.

The agent must run as root (in its container) for this; an agent that cannot build the sandbox
refuses python versions, unless ``SWITCHYARD_SANDBOX=off`` says to run them unisolated (a
developer's own machine; never a shared node).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# Tenant t's workers run as uid/gid UID_BASE + t: workers of two tenants never share a uid,
# so neither can signal, trace or read the files of the other.
UID_BASE = 200_000
MAX_PROCESSES = 64  # per worker: its threads count too (numpy's, ONNX Runtime's)
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "switchyard"
# Environment variables a worker gets; nothing of the agent's own environment passes.
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


class SandboxError(RuntimeError):
    """The sandbox cannot be built on this node (the load's failure, with the reason)."""


def mode() -> str:
    """``on`` (the default: isolate or refuse) or ``off`` (run unisolated; development only)."""
    return "off" if os.environ.get("SWITCHYARD_SANDBOX", "on").lower() == "off" else "on"


def check_tools() -> None:
    """Refuse early, with the reason, on a node that cannot isolate a worker."""
    if mode() == "off":
        return
    if os.geteuid() != 0:
        raise SandboxError(
            "python versions run in a sandbox that needs the agent to run as root in its "
            "container (set SWITCHYARD_SANDBOX=off to run them unisolated on your own machine)"
        )
    missing = [tool for tool in ("bwrap", "setpriv", "prlimit") if shutil.which(tool) is None]
    if missing:
        raise SandboxError(f"this node lacks {', '.join(missing)} (apt install bubblewrap)")


@dataclass
class Cgroup:
    """A worker's cgroups (v1 controllers, or one v2 group), where the node lets the agent
    make them; ``limits`` says which limits hold."""

    name: str
    paths: list[Path] = field(default_factory=list)
    limits: list[str] = field(default_factory=list)
    memory: Path | None = None

    @classmethod
    def create(cls, name: str, memory_bytes: int, cpus: float) -> Cgroup:
        group = cls(name)
        if mode() == "off":
            return group
        quota = int(cpus * 100_000)
        if (CGROUP_ROOT / "cgroup.controllers").exists():  # v2: one tree
            path = CGROUP_ROOT / CGROUP_PARENT / name
            settings = {
                "memory.max": str(memory_bytes),
                "memory.swap.max": "0",
                "pids.max": str(MAX_PROCESSES),
                "cpu.max": f"{quota} 100000",
            }
            group._make(path, settings)
            group.memory = path if "memory.max" in group.limits else None
        else:  # v1: a tree per controller
            for controller, settings in (
                (
                    "memory",
                    {
                        "memory.limit_in_bytes": str(memory_bytes),
                        "memory.memsw.limit_in_bytes": str(memory_bytes),  # no way out by swap
                    },
                ),
                ("pids", {"pids.max": str(MAX_PROCESSES)}),
                ("cpu", {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": str(quota)}),
            ):
                path = CGROUP_ROOT / controller / CGROUP_PARENT / name
                group._make(path, settings)
                if controller == "memory" and path in group.paths:
                    group.memory = path
        return group

    def _make(self, path: Path, settings: dict[str, str]) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("cgroup %s cannot be made (%s): limits by rlimit only", path, exc)
            return
        self.paths.append(path)
        for key, value in settings.items():
            try:
                (path / key).write_text(value)
                self.limits.append(key)
            except OSError as exc:
                logger.debug("cgroup %s: %s not set (%s)", path, key, exc)

    @property
    def procs(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this group for its memory limit."""
        if self.memory is None:
            return False
        for name in ("memory.events", "memory.oom_control"):
            try:
                text = (self.memory / name).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                    return True
        return False

    def remove(self) -> None:
        for path in self.paths:
            try:
                path.rmdir()
            except OSError:
                pass  # a process still in it is gone in a moment; the name is reused later


@dataclass(frozen=True)
class Layout:
    """The paths one worker is given."""

    python: Path  # the environment's interpreter
    environment: Path
    package: Path
    scratch: Path
    hide: tuple[str, ...] = ()  # files under /etc the worker must not read (a token file)


def tenant_ids(tenant_id: int) -> tuple[int, int]:
    return UID_BASE + tenant_id, UID_BASE + tenant_id


def command(
    layout: Layout,
    argv: list[str],
    *,
    tenant_id: int,
    network: bool,
    memory_bytes: int,
    cpus: float,
    cgroup: Cgroup,
) -> tuple[list[str], dict[str, str]]:
    """The command line that starts ``argv`` (run by the environment's python) in the sandbox,
    and the environment to start it with."""
    threads = str(max(1, math.ceil(cpus)))
    env = {
        **BASE_ENV,
        "HOME": str(layout.scratch),
        "TMPDIR": str(layout.scratch / "tmp"),
        # Numeric libraries size their thread pools by the node's cores, not the worker's.
        "OMP_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
    }
    python = [str(layout.python), "-s", *argv]
    if mode() == "off":
        return python, env
    uid, gid = tenant_ids(tenant_id)
    limits = ["prlimit", "--core=0", "--nofile=1024", f"--nproc={MAX_PROCESSES * 4}"]
    if cgroup.memory is None:  # no memory cgroup: bound the data segment instead
        limits.append(f"--data={memory_bytes}")
    wrap = [*limits, "--", "bwrap", "--die-with-parent", "--new-session"]
    wrap += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        wrap.append("--unshare-net")
    for top in ("/usr", "/etc"):
        wrap += ["--ro-bind", top, top]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            wrap += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            wrap += ["--ro-bind", top, top]
    for hidden in layout.hide:
        if os.path.isfile(hidden):
            wrap += ["--ro-bind", "/dev/null", hidden]
    wrap += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
    base = Path(sys.base_prefix).resolve()
    exposed = [(base, False), (layout.environment, False), (layout.package, False)]
    exposed.append((layout.scratch, True))
    made: set[Path] = set()
    for path, _ in exposed:
        for parent in reversed(path.parents):
            # Folders on the way get plain permissions: the node's own (/root is 0700) would
            # stop the worker's uid before it reaches what it was given.
            if parent != Path("/") and parent not in made and not _system(parent):
                wrap += ["--perms", "0755", "--dir", str(parent)]
                made.add(parent)
    for path, writable in exposed:
        wrap += ["--bind" if writable else "--ro-bind", str(path), str(path)]
    wrap += ["--chdir", str(layout.package), "--clearenv"]
    for key, value in env.items():
        wrap += ["--setenv", key, value]
    drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs"]
    drop += ["--inh-caps=-all", "--bounding-set=-all", "--"]
    # sh joins the cgroups before anything else starts, so every process of the worker is in.
    join = 'for p in $SWITCHYARD_CGROUPS; do echo $$ > "$p" || exit 71; done; exec "$@"'
    line = ["/bin/sh", "-c", join, "sh", *wrap, *drop, *python]
    return line, {**BASE_ENV, "SWITCHYARD_CGROUPS": " ".join(cgroup.procs)}


def _system(path: Path) -> bool:
    """A folder the sandbox already has (under a bound tree)."""
    return any(path == Path(top) or Path(top) in path.parents for top in ("/usr", "/etc"))


def prepare_scratch(scratch: Path, tenant_id: int) -> None:
    """A fresh scratch folder only the worker's uid can enter."""
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "tmp").mkdir(parents=True)
    if mode() == "off":
        return
    uid, gid = tenant_ids(tenant_id)
    for path in (scratch, scratch / "tmp"):
        os.chown(path, uid, gid)
        path.chmod(0o700)


def share_package(package: Path, tenant_id: int) -> None:
    """Make an extracted package readable by its tenant's workers only (group of the tenant)."""
    if mode() == "off":
        return
    _, gid = tenant_ids(tenant_id)
    for path in (package, *package.rglob("*")):
        os.chown(path, 0, gid, follow_symlinks=False)
        path.chmod(0o750 if path.is_dir() else 0o640)
