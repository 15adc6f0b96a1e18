"""The ``python`` model format's package: a directory or archive (zip, tar, gzipped tar) with a
``switchyard.toml`` manifest, the module its entrypoint names, its artifacts, pinned
``requirements.txt`` and optionally ``wheels/*.whl`` to install from. The one reader of it: the
registry checks uploads with it, the agent extracts and builds environments with it, and the
contract is in ``docs/custom-code.md``.

Nothing here runs the package's code; every name, size and field is checked before use (an
upload is a tenant's, hostile until proven otherwise). Standard library only: the platform
imports it in every Django process.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import stat
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any

MANIFEST = "switchyard.toml"
REQUIREMENTS = "requirements.txt"
WHEELS = "wheels/"

# Bounds on what a package may hold (an archive bomb is refused before anything is written).
MAX_FILES = 2000
MAX_TOTAL_BYTES = 4 << 30
MAX_MANIFEST_BYTES = 64 << 10
MAX_REQUIREMENTS = 200
MAX_NAME = 255
MAX_TENSORS = 64
MAX_FEATURES = 1024

DATATYPES = {
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
}
# What a worker may use unless the manifest says otherwise, and the most it may ask for.
DEFAULT_MEMORY_MIB = 1024
MAX_MEMORY_MIB = 256 << 10
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 3600.0
DEFAULT_CPUS = 1.0
MAX_CPUS = 256.0

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
# A pinned requirement: a PEP 503 name with optional extras, ``==`` an exact version. Anything
# else (ranges, URLs, paths, pip options such as --index-url) is refused: an environment is
# cached by its requirements, so they must name one build each.
_PINNED = re.compile(
    r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)"
    r"(?:\[(?P<extras>[A-Za-z0-9._-]+(?:\s*,\s*[A-Za-z0-9._-]+)*)\])?"
    r"\s*==\s*(?P<version>[A-Za-z0-9.+!_-]{1,64})"
)
_WHEEL = re.compile(r"[A-Za-z0-9_.+!-]+\.whl")


class PackageError(ValueError):
    """A package that breaks the contract; ``field`` names where (a file or a manifest key)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


# A generating package's fixed signature: a prompt in, text out (registry.formats'
# TEXTGEN_INPUTS and TEXTGEN_OUTPUTS, which every generative format has).
GENERATOR_INPUTS = [Tensor("prompt", "BYTES", [-1])]
GENERATOR_OUTPUTS = [Tensor("text", "BYTES", [-1])]


@dataclass(frozen=True)
class Manifest:
    """``switchyard.toml``, checked."""

    module: str  # dotted, relative to the package root
    cls: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    features: list[str] = field(default_factory=list)  # named features of a [-1, n] input
    memory_mib: int = DEFAULT_MEMORY_MIB
    cpus: float = DEFAULT_CPUS
    timeout_s: float = DEFAULT_TIMEOUT_S  # per model call (one batch; a generator's one step)
    network: bool = False  # the worker may open network connections
    # ``[model] generates = true``: the class's ``generate(prompt, parameters)`` streams text
    # (the ``python_generator`` format); the signature is then GENERATOR_INPUTS/OUTPUTS.
    generates: bool = False

    @property
    def entrypoint(self) -> str:
        return f"{self.module}:{self.cls}"


@dataclass(frozen=True)
class Member:
    name: str  # relative to the package root
    size: int
    raw: str = field(default="", compare=False, repr=False)  # its name in the archive


@dataclass(frozen=True)
class Package:
    manifest: Manifest
    members: list[Member]
    requirements: list[str]  # normalised "name[extras]==version" lines
    wheels: dict[str, str]  # wheels/ file name -> sha256
    prefix: str = ""  # the one top-level folder the archive wraps everything in, if any

    def environment_key(self, python: str | None = None) -> str:
        """What names the environment this package runs in: its requirements, the wheels it
        ships and the Python that runs them. Packages with the same key share one."""
        python = python or f"{sys.version_info[0]}.{sys.version_info[1]}"
        described = {"python": python, "requirements": self.requirements, "wheels": self.wheels}
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


# Reading ---------------------------------------------------------------------------------


class _Archive:
    """A zip or a (compressed) tar, or a directory, read through one small interface."""

    def __init__(self, source: Path | IO[bytes]) -> None:
        self._dir: Path | None = None
        self._zip: zipfile.ZipFile | None = None
        self._tar: tarfile.TarFile | None = None
        if isinstance(source, Path) and source.is_dir():
            self._dir = source
            return
        handle: IO[bytes] = source.open("rb") if isinstance(source, Path) else source
        handle.seek(0)
        head = handle.read(4)
        handle.seek(0)
        try:
            if head.startswith(b"PK"):
                self._zip = zipfile.ZipFile(handle)
            else:
                self._tar = tarfile.open(fileobj=handle, mode="r:*")
        except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
            raise PackageError("artifact", f"not a zip or tar archive: {exc}") from None

    def members(self) -> Iterator[tuple[str, int, bool]]:
        """(name, size, is_dir) of every entry; anything but files and folders is refused."""
        if self._dir is not None:
            for path in sorted(self._dir.rglob("*")):
                mode = path.lstat().st_mode
                name = path.relative_to(self._dir).as_posix()
                if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise PackageError(name, "only files and folders are allowed (no links)")
                yield name, path.stat().st_size if stat.S_ISREG(mode) else 0, stat.S_ISDIR(mode)
        elif self._zip is not None:
            for info in self._zip.infolist():
                mode = info.external_attr >> 16
                if mode and stat.S_ISLNK(mode):
                    raise PackageError(info.filename, "only files and folders are allowed")
                yield info.filename, info.file_size, info.is_dir()
        else:
            assert self._tar is not None
            try:
                for member in self._tar:
                    if not (member.isfile() or member.isdir()):
                        raise PackageError(member.name, "only files and folders are allowed")
                    yield member.name, member.size, member.isdir()
            except (tarfile.TarError, EOFError, OSError) as exc:
                raise PackageError("artifact", f"the archive cannot be read: {exc}") from None

    def read(self, name: str, limit: int) -> bytes:
        try:
            if self._dir is not None:
                with (self._dir / name).open("rb") as handle:
                    data = handle.read(limit + 1)
            elif self._zip is not None:
                with self._zip.open(name) as handle:
                    data = handle.read(limit + 1)
            else:
                assert self._tar is not None
                extracted = self._tar.extractfile(name)
                assert extracted is not None
                data = extracted.read(limit + 1)
        except (KeyError, OSError, zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
            raise PackageError(name, f"cannot be read: {exc}") from None
        if len(data) > limit:
            raise PackageError(name, f"is larger than {limit} bytes")
        return data

    def copy_to(self, name: str, target: Path) -> None:
        if self._dir is not None:
            shutil.copyfile(self._dir / name, target)
            return
        if self._zip is not None:
            source: IO[bytes] = self._zip.open(name)
        else:
            assert self._tar is not None
            extracted = self._tar.extractfile(name)
            assert extracted is not None
            source = extracted
        with source, target.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)


def _clean_name(raw: str) -> str | None:
    """A member's path relative to the archive's root; refuses absolute ones and ``..``."""
    name = raw.replace("\\", "/")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise PackageError(raw[:MAX_NAME], "absolute paths are not allowed")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if not parts:
        return None
    if any(p == ".." for p in parts):
        raise PackageError(raw[:MAX_NAME], "'..' is not allowed in a path")
    if len(name) > MAX_NAME or any(ord(c) < 32 for c in name):
        raise PackageError(raw[:MAX_NAME], "a path must be printable and at most 255 characters")
    return "/".join(parts)


def _listing(archive: _Archive) -> tuple[list[Member], str]:
    """The files under the package root (names made relative to it) and the root's prefix."""
    files: list[Member] = []
    total = 0
    for raw, size, is_dir in archive.members():
        name = _clean_name(raw)
        if name is None or is_dir:
            continue
        files.append(Member(name, size, raw))
        total += size
        if len(files) > MAX_FILES:
            raise PackageError("artifact", f"more than {MAX_FILES} files")
        if total > MAX_TOTAL_BYTES:
            raise PackageError("artifact", f"more than {MAX_TOTAL_BYTES >> 30} GiB unpacked")
    names = {m.name for m in files}
    if len(names) != len(files):
        raise PackageError("artifact", "a path appears twice")
    if MANIFEST in names:
        return files, ""
    # One folder wrapping everything (``tar czf pkg.tgz mypkg/``) is the root.
    tops = {m.name.split("/", 1)[0] for m in files}
    if len(tops) == 1 and all("/" in m.name for m in files):
        prefix = tops.pop() + "/"
        if prefix + MANIFEST in names:
            return [Member(m.name[len(prefix) :], m.size, m.raw) for m in files], prefix
    raise PackageError(MANIFEST, "missing: a python package needs a switchyard.toml at its root")


def read_package(source: Path | IO[bytes]) -> Package:
    """Check a package without extracting or running anything; ``PackageError`` says what is
    wrong."""
    archive = _Archive(source)
    members, prefix = _listing(archive)
    by_name = {m.name: m.raw for m in members}
    names = set(by_name)
    manifest = parse_manifest(archive.read(by_name[MANIFEST], MAX_MANIFEST_BYTES))
    module_file = manifest.module.replace(".", "/")
    if f"{module_file}.py" not in names and f"{module_file}/__init__.py" not in names:
        raise PackageError("model.entrypoint", f"no {module_file}.py in the package")
    requirements: list[str] = []
    if REQUIREMENTS in names:
        requirements = parse_requirements(archive.read(by_name[REQUIREMENTS], 1 << 20))
    wheels: dict[str, str] = {}
    for member in members:
        if member.name.startswith(WHEELS):
            wheel = member.name[len(WHEELS) :]
            if not _WHEEL.fullmatch(wheel):
                raise PackageError(member.name, "wheels/ holds only .whl files, no folders")
            data = archive.read(member.raw, MAX_TOTAL_BYTES)
            wheels[wheel] = hashlib.sha256(data).hexdigest()
    return Package(manifest, members, requirements, wheels, prefix)


def read_member(source: Path | IO[bytes], package: Package, name: str, limit: int) -> bytes:
    """One file of a checked package, by its name in the package."""
    member = next((m for m in package.members if m.name == name), None)
    if member is None:
        raise PackageError(name, "not in the package")
    return _Archive(source).read(member.raw, limit)


def extract_package(source: Path | IO[bytes], target: Path) -> Package:
    """Check the package, then write its files under ``target`` (created; must not exist)."""
    package = read_package(source)
    archive = _Archive(source)
    target.mkdir(parents=True)
    for member in package.members:
        path = target / member.name
        path.parent.mkdir(parents=True, exist_ok=True)
        archive.copy_to(member.raw, path)
    return package


# The manifest ----------------------------------------------------------------------------


def parse_manifest(data: bytes) -> Manifest:
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PackageError(MANIFEST, f"not valid TOML: {exc}") from None
    model = _table(doc, "model")
    entrypoint = model.get("entrypoint")
    if not isinstance(entrypoint, str) or entrypoint.count(":") != 1:
        raise PackageError("model.entrypoint", "must be 'module:Class', e.g. 'model:Model'")
    module, cls = entrypoint.split(":")
    if not all(_IDENT.fullmatch(p) for p in module.split(".")) or not _IDENT.fullmatch(cls):
        raise PackageError("model.entrypoint", "must be 'module:Class' of Python identifiers")
    generates = model.get("generates", False)
    if not isinstance(generates, bool):
        raise PackageError("model.generates", "must be true or false")
    if generates:
        # The signature of every generative version: declaring one is a mistake to point out.
        for key in ("inputs", "outputs"):
            if key in doc:
                raise PackageError(
                    key,
                    "a generating package (generates = true) takes a prompt and streams text: "
                    f"remove its [[{key}]]",
                )
        if "features" in model:
            raise PackageError("model.features", "a generating package has no features")
        inputs, outputs = list(GENERATOR_INPUTS), list(GENERATOR_OUTPUTS)
    else:
        inputs = _tensors(doc, "inputs")
        outputs = _tensors(doc, "outputs")
    features = model.get("features", [])
    if not isinstance(features, list) or not all(
        isinstance(f, str) and 0 < len(f) <= 128 for f in features
    ):
        raise PackageError("model.features", "must be a list of names")
    if len(features) > MAX_FEATURES or len(set(features)) != len(features):
        raise PackageError("model.features", f"at most {MAX_FEATURES} names, each once")
    if features and (
        len(inputs) != 1 or len(inputs[0].shape) != 2 or inputs[0].shape[1] != len(features)
    ):
        raise PackageError(
            "model.features", "name the columns of the one input, of shape [-1, len(features)]"
        )
    resources = _table(doc, "resources", required=False)
    policy = _table(doc, "policy", required=False)
    network = policy.get("network", False)
    if not isinstance(network, bool):
        raise PackageError("policy.network", "must be true or false")
    return Manifest(
        module=module,
        cls=cls,
        inputs=inputs,
        outputs=outputs,
        features=list(features),
        memory_mib=int(_number(resources, "memory_mib", DEFAULT_MEMORY_MIB, 64, MAX_MEMORY_MIB)),
        cpus=_number(resources, "cpus", DEFAULT_CPUS, 0.1, MAX_CPUS),
        timeout_s=_number(resources, "timeout_s", DEFAULT_TIMEOUT_S, 0.05, MAX_TIMEOUT_S),
        network=network,
        generates=generates,
    )


def _table(doc: dict[str, Any], key: str, required: bool = True) -> dict[str, Any]:
    value = doc.get(key, None if required else {})
    if not isinstance(value, dict):
        raise PackageError(key, f"a [{key}] table is required")
    return value


def _number(table: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise PackageError(f"resources.{key}", f"must be a number from {low} to {high}")
    return float(value)


def _tensors(doc: dict[str, Any], key: str) -> list[Tensor]:
    entries = doc.get(key)
    if not isinstance(entries, list) or not 0 < len(entries) <= MAX_TENSORS:
        raise PackageError(key, f"declare 1 to {MAX_TENSORS} [[{key}]] tables")
    tensors: list[Tensor] = []
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise PackageError(where, "must be a table with name, datatype and shape")
        name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
        if not isinstance(name, str) or not _TENSOR_NAME.fullmatch(name):
            raise PackageError(f"{where}.name", "1 to 128 letters, digits or _.:/-")
        if datatype not in DATATYPES:
            raise PackageError(f"{where}.datatype", f"must be one of {sorted(DATATYPES)}")
        if (
            not isinstance(shape, list)
            or not 1 <= len(shape) <= 8
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            or any(d < -1 or d == 0 or d > 1 << 31 for d in shape)
        ):
            raise PackageError(f"{where}.shape", "1 to 8 dimensions, each -1 or positive")
        if shape[0] != -1:
            raise PackageError(f"{where}.shape", "the first dimension is the batch: -1")
        tensors.append(Tensor(name, str(datatype), list(shape)))
    if len({t.name for t in tensors}) != len(tensors):
        raise PackageError(key, "a name appears twice")
    return tensors


def parse_requirements(data: bytes) -> list[str]:
    """Pinned requirements, one per line (``name==version``; comments and blank lines
    ignored), normalised and sorted."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PackageError(REQUIREMENTS, "not UTF-8 text") from None
    pinned: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PINNED.fullmatch(line)
        if match is None:
            raise PackageError(
                f"{REQUIREMENTS}:{number}",
                f"{line[:80]!r}: pin each requirement as name==version "
                "(no ranges, URLs or options)",
            )
        name = re.sub(r"[-_.]+", "-", match["name"]).lower()
        if name in pinned:
            raise PackageError(f"{REQUIREMENTS}:{number}", f"{name} is listed twice")
        extras = match["extras"]
        extras_part = (
            f"[{','.join(sorted(e.strip() for e in extras.split(',')))}]" if extras else ""
        )
        pinned[name] = f"{name}{extras_part}=={match['version']}"
    if len(pinned) > MAX_REQUIREMENTS:
        raise PackageError(REQUIREMENTS, f"at most {MAX_REQUIREMENTS} requirements")
    return sorted(pinned.values())
