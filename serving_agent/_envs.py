"""Environments for ``python`` packages: one virtual environment per distinct set of pinned
requirements (and shipped wheels, and Python), built once with ``uv`` (or ``venv`` + pip where
uv is absent), cached on the node by that set's hash and reused across versions and restarts.

Only wheels are installed (``--no-build`` / ``--only-binary :all:``): building a source
distribution runs its ``setup.py``, which here would run a tenant's chosen code as the agent.
Installing a wheel runs nothing; what it holds runs only in the package's sandboxed worker.

An environment is built in a folder of its own and renamed into place when complete, so a
build cut short (the agent killed) is never taken for a finished one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from importlib import util as import_util
from pathlib import Path

from .package import Package

logger = logging.getLogger(__name__)

# What a failed build reports of the installer's output (its end, where the error is).
ERROR_TAIL = 1800
BUILD_TIMEOUT_S = 900.0
READY = ".switchyard-ready"

Progress = Callable[[str], Awaitable[None]]


class EnvBuildError(RuntimeError):
    """An environment that could not be built; the message holds the installer's error."""


def _numpy_pin() -> str:
    import numpy

    return f"numpy=={numpy.__version__}"


def _uv() -> str | None:
    found = shutil.which("uv")
    beside = Path(sys.executable).parent / "uv"
    return found or (str(beside) if beside.exists() else None)


class Environments:
    """The environments under ``root``, built on demand. ``index_url``: the package index to
    install from (None: the installer's own configuration)."""

    def __init__(self, root: Path, index_url: str | None = None) -> None:
        self.root = root
        self.index_url = index_url
        self._locks: dict[str, asyncio.Lock] = {}

    def path(self, key: str) -> Path:
        return self.root / key

    def python(self, key: str) -> Path:
        return self.path(key) / "bin" / "python"

    def ready(self, key: str) -> bool:
        return (self.path(key) / READY).exists()

    async def ensure(self, package: Package, package_dir: Path, progress: Progress) -> Path:
        """The python of the package's environment, built first if this node has none."""
        key = package.environment_key()
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:  # two versions of one requirements set: one build
            if self.ready(key):
                # Built by an older agent, it may hold an older worker (one that cannot
                # stream a generating package's text): this agent's replaces it.
                await asyncio.to_thread(_refresh_worker, self.path(key))
                return self.python(key)
            count = len(package.requirements)
            await progress(f"building environment {key}: installing {count} requirement(s)")
            started = time.monotonic()
            await asyncio.to_thread(self._build, package, package_dir, key)
            logger.info("environment %s built in %.1f s", key, time.monotonic() - started)
            await progress(f"environment {key} built in {time.monotonic() - started:.1f} s")
            return self.python(key)

    def _build(self, package: Package, package_dir: Path, key: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # workers of every tenant read (never write) environments
        building = self.root / f".{key}.{os.getpid()}.building"
        shutil.rmtree(building, ignore_errors=True)
        try:
            requirements = list(package.requirements)
            if not any(r.startswith("numpy") for r in requirements):
                requirements.append(_numpy_pin())  # the worker's own need
            wheels = package_dir / "wheels"
            uv = _uv()
            if uv is not None:
                self._run([uv, "venv", "--quiet", "--python", sys.executable, str(building)])
                command = [uv, "pip", "install", "--quiet", "--no-build"]
                command += ["--python", str(building / "bin" / "python")]
            else:
                self._run([sys.executable, "-m", "venv", "--without-pip", str(building)])
                command = [
                    sys.executable,
                    "-m",
                    "pip",
                    "--python",
                    str(building / "bin" / "python"),
                ]
                command += ["install", "--quiet", "--only-binary", ":all:", "--no-input"]
            if self.index_url:
                command += ["--index-url", self.index_url]
            if wheels.is_dir():
                command += ["--find-links", str(wheels)]
            self._run([*command, *requirements])
            _refresh_worker(building)  # the worker, which a package's code may import
            (building / READY).write_text(
                json.dumps({"requirements": package.requirements, "wheels": package.wheels})
            )
            for path in (building, *building.rglob("*")):  # readable by every worker uid
                if not path.is_symlink():
                    path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
            target = self.path(key)
            if target.exists():  # a build another agent process finished meanwhile
                shutil.rmtree(building, ignore_errors=True)
            else:
                building.rename(target)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise

    @staticmethod
    def _run(command: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise EnvBuildError(f"the installer took more than {BUILD_TIMEOUT_S:.0f} s") from None
        except OSError as exc:
            raise EnvBuildError(f"the installer could not start: {exc}") from None
        if done.returncode != 0:
            output = (done.stderr or done.stdout or "").strip()
            raise EnvBuildError(
                f"{Path(command[0]).name} {command[1]} failed: {output[-ERROR_TAIL:]}"
            )


def _refresh_worker(env: Path) -> None:
    """Make the environment's copy of the worker this agent's, where it differs (each file
    replaced whole, so a worker starting meanwhile reads the old or the new one)."""
    spec = import_util.find_spec("switchyard_client.model")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    target = env / "lib" / version / "site-packages" / "switchyard_client"
    for name in ("__init__.py", "model.py"):
        data = (source / name).read_bytes()
        try:
            if (target / name).read_bytes() == data:
                continue
        except OSError:
            pass
        target.mkdir(parents=True, exist_ok=True)
        partial = target / f".{name}.{os.getpid()}"
        partial.write_bytes(data)
        partial.chmod(0o644)
        os.replace(partial, target / name)
        logger.info("environment %s: worker %s updated", env.name, name)
