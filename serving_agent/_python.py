"""The ``python`` format on the agent: a package's class run in a worker process of its own,
in the package's environment, inside the sandbox (``_sandbox``), never in the agent.

``prepare_python`` (before the load, with progress reported as the version's state) extracts
the package and builds or reuses its environment (``_envs``); ``load_python`` starts the
worker and loads the class in it, and returns a ``Runtime`` whose ``run`` sends the batch to
the worker and checks what comes back (the worker is untrusted: every byte of its answer is
checked like a client's). A worker that crashes, exceeds its memory or takes longer than the
package's ``timeout_s`` is killed; the batch in it fails with the reason, and the next batch
starts a new worker (its ``load()`` again). The agent and its other versions are untouched.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from switchyard_client.model import encode_tensor, pack, read_exactly, split_tensors, unpack

from . import _sandbox
from ._envs import Environments
from ._exceptions import BadInput, ModelFailed
from ._runtime import Runtime
from ._signature import check_signature
from .package import Manifest, Package, extract_package, read_package
from .protocol import TensorSpec, VersionSpec

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
MAX_REPLY_BYTES = 512 << 20  # a worker's answer to one batch
LOAD_TIMEOUT_S = 300.0  # the class's load(): reading its artifacts, warming its libraries
RESTART_AFTER_S = 1.0  # a worker that keeps dying is restarted at most this often
STDERR_LINES = 20  # of a worker's output kept to explain its death


def sandbox_root() -> Path:
    configured = os.environ.get("SWITCHYARD_SANDBOX_DIR")
    if configured:
        return Path(configured)
    if os.geteuid() == 0:
        return Path("/var/lib/switchyard-agent/sandbox")
    return Path("~/.cache/switchyard-agent-sandbox").expanduser()


_environments: dict[Path, Environments] = {}


def environments() -> Environments:
    root = sandbox_root() / "envs"
    if root not in _environments:
        _environments[root] = Environments(root, os.environ.get("SWITCHYARD_PACKAGE_INDEX"))
    return _environments[root]


def package_dir(spec: VersionSpec) -> Path:
    return sandbox_root() / "packages" / spec.sha256[:40]


async def prepare_python(
    path: Path, spec: VersionSpec, progress: Callable[[str], Awaitable[None]]
) -> None:
    """Extract the package (once per artifact) and build its environment (once per
    requirements set on this node), reporting progress; raises with what went wrong."""
    import asyncio

    _sandbox.check_tools()
    target = package_dir(spec)
    if not target.exists():
        await asyncio.to_thread(_extract, path, target, spec.tenant_id)
    package = await asyncio.to_thread(read_package, target)
    await environments().ensure(package, target, progress)


def _extract(artifact: Path, target: Path, tenant_id: int) -> None:
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)  # workers pass through to their own package, and list nothing
    partial = root / f".{target.name}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        extract_package(artifact, partial)
        _sandbox.share_package(partial, tenant_id)
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def load_python(
    path: Path,
    spec: VersionSpec,
    threads: int = 1,
    *,
    wrap: Callable[[Runtime], Runtime] | None = None,
) -> Runtime:
    """The agent's loader for ``python`` versions (``serving_agent.formats``); the package was
    prepared (``prepare_python``)."""
    check_signature(spec.inputs)
    check_signature(spec.outputs)
    target = package_dir(spec)
    package = read_package(target)
    key = package.environment_key()
    if not environments().ready(key):
        raise RuntimeError(f"the environment {key} is not built")
    runtime = PythonRuntime(spec, package, target, environments().python(key))
    runtime.start()
    return runtime if wrap is None else wrap(runtime)


class RowResults(list[np.ndarray]):
    """A batch's outputs where some rows failed: ``row_errors`` {row: message}."""

    def __init__(self, outputs: list[np.ndarray], row_errors: dict[int, str]) -> None:
        super().__init__(outputs)
        self.row_errors = row_errors


@dataclass
class _Process:
    """One running worker."""

    popen: subprocess.Popen[bytes]
    sock: socket.socket
    cgroup: _sandbox.Cgroup
    scratch: Path
    started: float
    stderr: collections.deque[str]


class PythonRuntime(Runtime):
    """A package's class in its sandboxed worker. ``run`` is called by one thread at a time
    (the batcher's), like every runtime's; the lock makes sure of it."""

    # Never run on the event loop: a batch waits on another process (up to its timeout).
    blocks = True

    def __init__(
        self,
        spec: VersionSpec,
        package: Package,
        folder: Path,
        python: Path,
        *,
        generates: bool = False,
    ) -> None:
        self.spec = spec
        # The worker serves streams of text (a ``python_generator`` package, whose engine,
        # ``_python_engine``, talks to it through ``worker`` and ``end``), not batches.
        self.generates = generates
        self.manifest: Manifest = package.manifest
        self.folder = folder
        self.python = python
        self.input_names = [t.name for t in spec.inputs]
        self.output_names = [t.name for t in spec.outputs]
        self.provider = "python (sandboxed)" if _sandbox.mode() == "on" else "python (unisolated)"
        self._lock = threading.Lock()
        self._process: _Process | None = None
        self._starts = 0
        self._last_start = 0.0
        self._failure: str | None = None  # why the last start failed, repeated until retried
        self.restarts = 0

    # The worker ------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            self._start()

    def _start(self) -> None:
        self._last_start = time.monotonic()
        self._starts += 1
        name = f"v{self.spec.version_id}-{os.getpid()}-{self._starts}"
        scratch = sandbox_root() / "scratch" / name
        _sandbox.prepare_scratch(scratch, self.spec.tenant_id)
        memory = self.manifest.memory_mib << 20
        cgroup = _sandbox.Cgroup.create(name, memory, self.manifest.cpus)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        layout = _sandbox.Layout(
            python=self.python,
            environment=self.python.parent.parent,
            package=self.folder,
            scratch=scratch,
            hide=tuple(filter(None, [os.environ.get("SWITCHYARD_NODE_TOKEN_FILE", "")])),
        )
        argv, env = _sandbox.command(
            layout,
            ["-m", "switchyard_client.model", "--fd", str(theirs.fileno())],
            tenant_id=self.spec.tenant_id,
            network=self.manifest.network,
            memory_bytes=memory,
            cpus=self.manifest.cpus,
            cgroup=cgroup,
        )
        try:
            popen = subprocess.Popen(
                argv,
                env=env,
                cwd=self.folder,  # the sandbox sets it again inside; unisolated, this is it
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            cgroup.remove()
            raise ModelFailed(f"the worker could not start: {exc}") from None
        finally:
            theirs.close()
        process = _Process(popen, ours, cgroup, scratch, time.monotonic(), collections.deque())
        threading.Thread(
            target=_drain, args=(popen, process.stderr, self.spec), daemon=True
        ).start()
        self._process = process
        outputs = [t.model_dump(include={"name", "datatype"}) for t in self.spec.outputs]
        header = {"op": "load", "id": 0, "package": str(self.folder)}
        header |= {"entrypoint": self.manifest.entrypoint, "outputs": outputs}
        if self.generates:
            header["generates"] = True
        try:
            reply, _ = self._call(process, pack(header), LOAD_TIMEOUT_S, "load()")
        except ModelFailed as exc:
            self._failure = str(exc)
            raise
        if not reply.get("ok"):
            self._stop(process)
            self._failure = f"load() failed: {_message(reply)}"
            raise ModelFailed(self._failure)
        self._failure = None

    def _call(
        self, process: _Process, message: bytes, timeout: float, what: str
    ) -> tuple[dict[str, object], memoryview]:
        """Send one message and read its answer; a worker that dies or overruns is killed and
        the failure raised with the reason."""
        deadline = time.monotonic() + timeout
        process.sock.settimeout(timeout)
        try:
            process.sock.sendall(message)
            head = read_exactly(process.sock, 4, deadline)
            length = _LENGTH.unpack(head)[0] if head is not None else 0
            if head is not None and length > MAX_REPLY_BYTES:
                self._stop(process)
                raise ModelFailed(f"the worker's answer to {what} exceeds {MAX_REPLY_BYTES} bytes")
            body = read_exactly(process.sock, length, deadline) if head is not None else None
        except TimeoutError:
            self._stop(process)
            raise ModelFailed(
                f"{what} did not finish within the package's {timeout:g} s: its worker was "
                "killed and starts again for the next request"
            ) from None
        except OSError:
            body = None
        if body is None:
            raise ModelFailed(f"the worker died during {what}: {self._death(process)}")
        try:
            return unpack(body)
        except ValueError as exc:
            self._stop(process)
            raise ModelFailed(
                f"the worker answered {what} with a malformed message: {exc}"
            ) from None

    def _death(self, process: _Process) -> str:
        """Why a worker ended, once it has."""
        try:
            code = process.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        oom = process.cgroup.oom_killed()
        self._stop(process)
        tail = " | ".join(list(process.stderr)[-3:])
        if oom:
            reason = f"killed for exceeding its {self.manifest.memory_mib} MiB memory limit"
        elif code is not None and code < 0:
            reason = f"killed by signal {signal.Signals(-code).name}"
        else:
            reason = f"exited with status {code}"
        return f"{reason}{'; its last output: ' + tail[-600:] if tail else ''}"

    def _stop(self, process: _Process) -> None:
        if self._process is process:
            self._process = None
        process.sock.close()
        if process.popen.poll() is None:
            os.killpg(process.popen.pid, signal.SIGKILL)  # bwrap; its sandbox dies with it
        _kill_cgroup(process.cgroup)
        try:
            process.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("worker of version %d did not exit", self.spec.version_id)
        process.cgroup.remove()
        shutil.rmtree(process.scratch, ignore_errors=True)

    def _alive(self) -> _Process:
        """The running worker, started again if it died (at most once per RESTART_AFTER_S)."""
        process = self._process
        if process is not None and process.popen.poll() is None:
            return process
        if process is not None:
            self._stop(process)
        if self._failure is not None and time.monotonic() - self._last_start < RESTART_AFTER_S:
            raise ModelFailed(self._failure)
        self.restarts += 1
        logger.warning("starting the worker of version %d again", self.spec.version_id)
        self._start()
        assert self._process is not None
        return self._process

    def worker(self) -> _Process:
        """The running worker, started (again) first if there is none: for the generation
        engine, which then speaks to it directly. Blocking (a start runs ``load()``)."""
        with self._lock:
            return self._alive()

    def end(self, process: _Process, died: bool) -> str:
        """Kill a worker the generation engine gave up on; with ``died``, why it ended (its
        exit status, an out-of-memory kill, its last output). Blocking (waits for the exit)."""
        with self._lock:
            if died:
                return self._death(process)
            self._stop(process)
            return ""

    # Runtime ------------------------------------------------------------------------------------

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        with self._lock:
            process = self._alive()
            metas, buffers = [], []
            for spec in self.spec.inputs:
                meta, data = encode_tensor(spec.name, spec.datatype, inputs[spec.name])
                metas.append(meta)
                buffers.append(data)
            message = pack({"op": "predict", "id": 1, "inputs": metas}, buffers)
            reply, data = self._call(process, message, self.manifest.timeout_s, "predict()")
        if not reply.get("ok"):
            if reply.get("code") == "bad_input":
                raise BadInput(_message(reply))
            raise ModelFailed(f"the model's code raised {_message(reply)}")
        return self._outputs(reply, data, _rows(inputs))

    def _outputs(self, reply: dict[str, object], data: memoryview, rows: int) -> list[np.ndarray]:
        """The worker's outputs, checked against the declared signature."""
        try:
            arrays = split_tensors(reply.get("outputs"), data, limit=len(self.spec.outputs))
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelFailed(f"the worker's outputs are malformed: {exc}") from None
        metas = reply["outputs"]
        assert isinstance(metas, list)
        for spec, meta, array in zip(self.spec.outputs, metas, arrays, strict=False):
            _check_output(spec, meta, array)
        if len(arrays) != len(self.spec.outputs):
            raise ModelFailed(f"the worker answered {len(arrays)} outputs")
        errors = reply.get("errors") or {}
        if not isinstance(errors, dict):
            raise ModelFailed("the worker's row errors are malformed")
        row_errors: dict[int, str] = {}
        for row, message in errors.items():
            if not str(row).isdigit() or int(row) >= rows:
                raise ModelFailed(f"the worker named row {str(row)[:20]!r} of a {rows}-row batch")
            row_errors[int(row)] = str(message)[:1000]
        return RowResults(arrays, row_errors) if row_errors else arrays

    def outside_bytes(self) -> int:
        """What the worker holds (its cgroup's memory), for the version's footprint."""
        process = self._process
        if process is None or process.cgroup.memory is None:
            return 0
        for name in ("memory.current", "memory.usage_in_bytes"):
            try:
                return int((process.cgroup.memory / name).read_text())
            except (OSError, ValueError):
                continue
        return 0

    def close(self) -> None:
        with self._lock:
            if self._process is not None:
                self._stop(self._process)


def _check_output(spec: TensorSpec, meta: object, array: np.ndarray) -> None:
    if not isinstance(meta, dict) or meta.get("name") != spec.name:
        raise ModelFailed(f"the worker's outputs are not the declared {spec.name!r}")
    if meta.get("datatype") != spec.datatype:
        raise ModelFailed(f"output {spec.name!r} is {meta.get('datatype')}, not {spec.datatype}")
    if array.ndim != len(spec.shape) or any(
        want not in (-1, got) for want, got in zip(spec.shape[1:], array.shape[1:], strict=True)
    ):
        raise ModelFailed(
            f"output {spec.name!r} has shape {list(array.shape)}, declared {spec.shape}"
        )


def _rows(inputs: dict[str, np.ndarray]) -> int:
    return next(iter(inputs.values())).shape[0] if inputs else 0


def _message(reply: dict[str, object]) -> str:
    return str(reply.get("message", "no message"))[:1200]


def _drain(popen: subprocess.Popen[bytes], tail: collections.deque[str], spec: VersionSpec) -> None:
    """Log what the worker prints (its own logging, tracebacks), and keep its last lines."""
    assert popen.stderr is not None
    for raw in popen.stderr:
        line = raw.decode("utf-8", "replace").rstrip()[:500]
        tail.append(line)
        if len(tail) > STDERR_LINES:
            tail.popleft()
        logger.info("[%s v%d] %s", spec.model, spec.version, line)


def _kill_cgroup(cgroup: _sandbox.Cgroup) -> None:
    """Every process left in the worker's cgroups (a fork that outlived bwrap)."""
    for procs in cgroup.procs:
        try:
            pids = Path(procs).read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError, PermissionError):
                pass
