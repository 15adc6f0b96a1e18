"""``python`` model packages on the author's machine (``docs/custom-code.md``): a scaffold
that works as generated (``switchyard init``), the local check before an upload (the package's
class imported, loaded and called once, in a child process) and the archive that is uploaded
(``switchyard push MODEL DIR``). The platform checks the archive again on arrival; this only
catches what the author can fix before waiting for an upload.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "switchyard.toml"
PYTHON_FORMAT = "python"
# A package whose manifest says ``generates = true`` (its class streams text).
PYTHON_GENERATOR_FORMAT = "python_generator"
# Never packed: Python's caches and a git checkout's own folder.
SKIPPED_FOLDERS = frozenset({"__pycache__", ".git"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")
SMOKE_TIMEOUT_S = 300.0


class PackagingError(Exception):
    """A package folder that cannot be checked or packed, with what to do about it."""


# The scaffold --------------------------------------------------------------------------------

_MANIFEST_TEXT = """\
# {name}: a Switchyard python model package (docs/custom-code.md).
#
#   switchyard push {name} {folder}
#
# checks it on this machine first (the class imported, load() and one call on a row of zeros,
# the outputs against the signature below), then uploads this folder as {name}'s next version.

[model]
# The class the platform runs, as module:Class (the module relative to this folder).
entrypoint = "model:Model"
# Optional: the names of the one input's columns, so the prediction API takes named features.
features = ["f1", "f2", "f3", "f4"]

# The signature: what requests carry and what the model answers, in OIP v2 datatypes (FP32,
# INT64, BYTES, ...). The first dimension of every shape is the batch: -1.
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 4]

[[outputs]]
name = "score"
datatype = "FP32"
shape = [-1]

[[outputs]]
name = "label"
datatype = "INT64"
shape = [-1]

# What one worker process may use (these are the defaults); timeout_s is per call (one batch).
[resources]
memory_mib = 1024
cpus = 1.0
timeout_s = 30.0

# The worker may open no network connection unless this is true.
[policy]
network = false
"""

_MODEL_TEXT = '''\
"""{name}: a Switchyard python model (docs/custom-code.md).

The agent runs this class in a sandboxed worker process of its own, in an environment built
from requirements.txt: ``load()`` once, then for every batch of requests ``preprocess``,
``predict`` and ``postprocess`` in turn (only ``predict`` is required). A batch is a dict of
numpy arrays, one per input declared in switchyard.toml, one row per request row; the answer
holds every declared output with as many rows. Raise ``InvalidInput`` for a batch the model
cannot take at all (its callers get a 400 with the message); return ``Partial`` when only some
rows failed (their callers get a 400, the others their rows).

Try it on this machine: python -m switchyard_client.model --smoke {folder}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from switchyard_client.model import InvalidInput, Partial

# Read artifacts relative to this file: the same path on this machine and on an agent.
HERE = Path(__file__).parent


class Model:
    def load(self) -> None:
        """Once per worker process, before its first batch: read the artifacts."""
        params = json.loads((HERE / "weights.json").read_text())
        self.weights = np.asarray(params["weights"], dtype=np.float64)
        self.bias = float(params["bias"])

    def preprocess(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = np.asarray(batch["x"], dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.weights.shape[0]:
            raise InvalidInput(f"x must be rows of {{self.weights.shape[0]}} numbers")
        bad = ~np.isfinite(x).all(axis=1)  # such a row fails alone, not its whole batch
        return {{"x": np.where(bad[:, None], 0.0, x), "bad": bad}}

    def predict(self, features: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {{"logit": features["x"] @ self.weights + self.bias, "bad": features["bad"]}}

    def postprocess(self, predicted: dict[str, np.ndarray]) -> Any:
        score = 1.0 / (1.0 + np.exp(-predicted["logit"]))
        outputs = {{"score": score.astype(np.float32), "label": (score >= 0.5).astype(np.int64)}}
        errors = {{int(row): "x holds NaN or infinity" for row in np.flatnonzero(predicted["bad"])}}
        return Partial(outputs, errors) if errors else outputs
'''

_WEIGHTS_TEXT = '{"weights": [0.5, -0.25, 0.1, 0.8], "bias": 0.0}\n'

_REQUIREMENTS_TEXT = """\
# The package's requirements, each pinned exactly, one per line: name==version
# (e.g. scikit-learn==1.5.2). No ranges, URLs or pip options: an agent builds one environment
# per set of requirements, and every version pinning the same set shares it. Wheels of your
# own go in wheels/ (wheels/mylib-1.0-py3-none-any.whl), pinned here like any other.
#
# The worker that runs the class needs numpy, so numpy is always there: pin it here only if
# your code needs a particular version. This scaffold needs nothing else.
"""


def scaffold(folder: Path, name: str) -> list[Path]:
    """Write a working package into ``folder`` (created; it must not hold anything yet): the
    manifest, a numpy-only model, its artifact and an empty requirements.txt. Returns the
    files written."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise PackagingError(f"{folder} already exists and is not an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    shown = folder.as_posix() if folder.is_absolute() else f"./{folder.as_posix()}"
    texts = {
        MANIFEST: _MANIFEST_TEXT.format(name=name, folder=shown),
        "model.py": _MODEL_TEXT.format(name=name, folder=shown),
        "weights.json": _WEIGHTS_TEXT,
        "requirements.txt": _REQUIREMENTS_TEXT,
    }
    written = []
    for file_name, text in texts.items():
        path = folder / file_name
        path.write_text(text)
        written.append(path)
    return written


# The local check -----------------------------------------------------------------------------


@dataclass
class SmokeResult:
    """What the local check said: the JSON report of ``switchyard_client.model --smoke`` (the
    outputs' types and shapes, or ``error``), and the child's stderr (a traceback)."""

    ok: bool
    report: dict[str, Any] = field(default_factory=dict)
    log: str = ""

    @property
    def error(self) -> str:
        found = self.report.get("error")
        if isinstance(found, str) and found:
            return found
        lines = [line for line in self.log.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "the check failed without saying why"


def package_format(folder: Path) -> str:
    """The format a package folder uploads as: ``python_generator`` when its manifest says
    ``generates = true``, else ``python`` (the registry checks the manifest again)."""
    try:
        manifest = tomllib.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return PYTHON_FORMAT  # the registry says what is wrong with it
    model = manifest.get("model")
    generates = isinstance(model, dict) and model.get("generates") is True
    return PYTHON_GENERATOR_FORMAT if generates else PYTHON_FORMAT


def check_folder(folder: Path) -> None:
    """What the local check needs before it starts: a folder with a manifest."""
    if not folder.is_dir():
        raise PackagingError(f"{folder} is not a folder")
    if not (folder / MANIFEST).is_file():
        raise PackagingError(
            f"no {MANIFEST} in {folder}: a python package has one at its root "
            f"(`switchyard init DIR` writes a working one)"
        )


def smoke(folder: Path, timeout_s: float = SMOKE_TIMEOUT_S) -> SmokeResult:
    """Run the package once on this machine, in a child process of this Python: its class
    imported and loaded, one row of zeros through it, its outputs checked against the
    manifest (``switchyard_client.model.smoke``). The package's own code runs here: this is
    the author's machine and the author's code."""
    check_folder(folder)
    command = [sys.executable, "-m", "switchyard_client.model", "--smoke", str(folder.resolve())]
    # No __pycache__ left in the author's folder by the check; run in the folder, as a worker
    # on an agent does.
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=folder,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return SmokeResult(
            ok=False,
            report={"error": f"the check did not finish in {timeout_s:g} s (load() and one call)"},
        )
    report: dict[str, Any] = {}
    # The last line of stdout is the report; the package may have printed before it.
    for line in reversed(done.stdout.strip().splitlines()):
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            report = parsed
            break
    ok = done.returncode == 0 and "error" not in report and "outputs" in report
    return SmokeResult(ok=ok, report=report, log=done.stderr)


# The archive ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    path: Path
    files: list[tuple[str, int]]  # (name in the archive, size), in the archive's order

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def package_files(folder: Path) -> list[tuple[str, Path]]:
    """The files a package folder holds, as (name in the archive, path), sorted by name;
    caches and .git are skipped, and a link or anything but files and folders is refused (the
    platform refuses them too, after the upload)."""
    found: list[tuple[str, Path]] = []

    def walk(current: Path, prefix: str) -> None:
        for path in sorted(current.iterdir(), key=lambda p: p.name):
            name = prefix + path.name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise PackagingError(
                    f"{name} is a symbolic link: a package holds only files and folders "
                    "(copy what it points at into the folder)"
                )
            if stat.S_ISDIR(mode):
                if path.name not in SKIPPED_FOLDERS:
                    walk(path, name + "/")
            elif stat.S_ISREG(mode):
                if not path.name.endswith(SKIPPED_SUFFIXES):
                    found.append((name, path))
            else:
                raise PackagingError(f"{name} is not a regular file")

    walk(folder, "")
    return sorted(found)


def pack(folder: Path, target: Path) -> Packed:
    """Write ``folder`` as a gzipped tar at ``target``. The same files make the same bytes:
    names sorted, times, owners and the gzip header zeroed."""
    check_folder(folder)
    files = package_files(folder)
    listed: list[tuple[str, int]] = []
    with (
        target.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name, path in files:
            info = tarfile.TarInfo(name)
            info.size = path.stat().st_size
            info.mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with path.open("rb") as handle:
                tar.addfile(info, handle)
            listed.append((name, info.size))
    return Packed(target, listed)
