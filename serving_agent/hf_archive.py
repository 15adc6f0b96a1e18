"""The ``hf`` artifact: a Hugging Face causal LM packed as one archive, checked without running
any code from it.

An archive (tar, tar.gz or zip) holds, at its root or under one top directory:
``config.json`` of a supported architecture, ``*.safetensors`` weights, ``tokenizer.json``, and
optionally ``tokenizer_config.json`` (chat template, special tokens) and
``generation_config.json``. The registry calls ``check_archive`` at upload; the agent calls
``extract`` (which checks again) before loading. What is refused, and why:

- anything that would be unpickled: ``*.bin``/``*.pt``/``*.pth``/``*.pkl``/``*.ckpt`` and any
  member whose bytes start like a pickle (protocol 2-5) or like a nested archive (a torch
  checkpoint is a zip of pickles);
- remote code: ``auto_map`` or ``trust_remote_code`` in a config, ``*.py`` members, a
  ``model_type`` outside ``SUPPORTED``;
- members that could write outside the extraction directory or are not plain files (absolute
  paths, ``..``, links, devices), and archives that expand past their bounds (zip bombs).

Only the files the agent reads are extracted; the others (a README, a licence) are checked and
skipped. This module imports neither torch nor transformers (the registry checks uploads with
it); ``tokenizers`` and ``jinja2`` are imported when a check needs them.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import posixpath
import struct
import tarfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from .pickles import pickle_protocol

# model_type -> the transformers class that serves it (built from config.json, never from code
# in the archive).
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
CODE_SUFFIXES = (".py", ".pyc", ".so")
JSON_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
# transformers writes the chat template into tokenizer_config.json or, since 4.43, beside it
# as chat_template.jinja.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Sharded weights: which tensor is in which *.safetensors file.
WEIGHTS_INDEX = "model.safetensors.index.json"
EXTRACTED = (
    *JSON_FILES,
    "tokenizer.json",
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    WEIGHTS_INDEX,
)
SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}

MAX_MEMBERS = 64
MAX_JSON_BYTES = 4 * 1024 * 1024
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES = 32 * 1024**3  # what all members may expand to together


@dataclass
class Member:
    """One regular file of the archive, by its name inside the model directory."""

    name: str
    size: int


@dataclass
class Manifest:
    """What a checked archive holds."""

    model_type: str
    config: dict[str, Any]
    weights: list[str]
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    parameters: int = 0


class _Archive:
    """A tar (any compression tarfile reads) or zip archive, read member by member."""

    def __init__(self, source: str | Path | IO[bytes], max_total: int) -> None:
        self.max_total = max_total
        self._zip: zipfile.ZipFile | None = None
        self._tar: tarfile.TarFile | None = None
        fileobj = source if not isinstance(source, str | Path) else open(source, "rb")  # noqa: SIM115
        self._own = fileobj is not source
        self._file = fileobj
        self._gzip: gzip.GzipFile | None = None
        head = fileobj.read(4)
        fileobj.seek(0)
        try:
            if head == b"PK\x03\x04":
                self._zip = zipfile.ZipFile(fileobj)
            else:
                stream: IO[bytes] = fileobj
                if head.startswith(b"\x1f\x8b"):
                    self._gzip = gzip.GzipFile(fileobj=fileobj, mode="rb")
                    stream = cast(IO[bytes], self._gzip)
                _check_tar_headers(stream, max_total)
                stream.seek(0)
                self._tar = tarfile.open(fileobj=stream, mode="r:")
        except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
            self.close()
            raise ValueError(f"not a tar, tar.gz or zip archive: {exc}") from None
        self.members = self._list()

    def close(self) -> None:
        for handle in (self._zip, self._tar, self._gzip):
            if handle is not None:
                handle.close()
        if self._own:
            self._file.close()

    def _list(self) -> dict[str, Member]:
        raw: list[tuple[str, int]] = []
        total = 0
        for name, size, kind in self._entries():
            if len(raw) >= MAX_MEMBERS:
                raise ValueError(f"the archive holds more than {MAX_MEMBERS} files")
            if kind == "dir":
                continue
            if kind != "file":
                raise ValueError(f"{name!r} is a {kind}: only regular files are accepted")
            total += size
            if total > self.max_total:
                raise ValueError(f"the archive expands past {self.max_total} bytes")
            raw.append((_safe_name(name), size))
        tops = {n.split("/", 1)[0] for n, _ in raw if "/" in n}
        prefix = f"{tops.pop()}/" if len(tops) == 1 and all("/" in n for n, _ in raw) else ""
        members: dict[str, Member] = {}
        for name, size in raw:
            short = name[len(prefix) :]
            if "/" in short:
                raise ValueError(f"{name!r}: files must sit at the root or under one directory")
            if short in members:
                raise ValueError(f"{short!r} is in the archive twice")
            members[short] = Member(name, size)
        return members

    def _entries(self) -> Iterator[tuple[str, int, str]]:
        if self._zip is not None:
            for info in self._zip.infolist():
                mode = (info.external_attr >> 16) & 0o170000
                if info.is_dir():
                    kind = "dir"
                elif mode not in (0, 0o100000):
                    kind = "link" if mode == 0o120000 else "special file"
                else:
                    kind = "file"
                if info.flag_bits & 0x1:
                    raise ValueError(f"{info.filename!r} is encrypted")
                yield info.filename, info.file_size, kind
            return
        assert self._tar is not None
        try:
            for entry in self._tar:
                if entry.isdir():
                    kind = "dir"
                elif entry.issym() or entry.islnk():
                    kind = "link"
                elif entry.isreg():
                    kind = "file"
                else:
                    kind = "device or special file"
                yield entry.name, entry.size, kind
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise ValueError(f"the archive is damaged: {exc}") from None

    @contextmanager
    def open(self, short: str) -> Iterator[_Bounded]:
        member = self.members[short]
        try:
            if self._zip is not None:
                with self._zip.open(member.name) as f:
                    yield _Bounded(f, member.size)
                return
            assert self._tar is not None
            extracted = self._tar.extractfile(member.name)
            if extracted is None:
                raise ValueError(f"{short!r} cannot be read")
            with extracted:
                yield _Bounded(extracted, member.size)
        except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as exc:
            raise ValueError(f"{short!r} cannot be read: {exc}") from None

    def read(self, short: str, limit: int) -> bytes:
        size = self.members[short].size
        if size > limit:
            raise ValueError(f"{short} is {size} bytes; at most {limit} are accepted")
        with self.open(short) as f:
            return f.read()


def _tar_number(field: bytes) -> int:
    """A tar header's number: octal text, or base-256 when the first byte's high bit is set."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        return -value if field[0] == 0xFF else value
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise ValueError("the archive is damaged: a header has no valid size") from None


def _check_tar_headers(stream: IO[bytes], max_total: int) -> None:
    """Walk a tar's headers before ``tarfile`` does: it reads a PAX or GNU long-name header's
    data into memory whole, and skips a member by decompressing all of it, so a small gzip could
    make either take gigabytes. Here such headers are bounded, and the declared sizes are summed
    (and refused past ``max_total``) before any data is skipped."""
    total = 0
    for _ in range(4 * MAX_MEMBERS):  # each member: at most a PAX and a long-name header too
        block = stream.read(512)
        if len(block) < 512 or block == bytes(512):
            return
        size = _tar_number(block[124:136])
        if block[156:157] in (b"x", b"g", b"L", b"K") and size > MAX_JSON_BYTES:
            raise ValueError("the archive has an oversized metadata header")
        total += size
        if size < 0 or total > max_total:
            raise ValueError(f"the archive expands past {max_total} bytes")
        stream.seek(-(-size // 512) * 512, io.SEEK_CUR)
    raise ValueError(f"the archive holds more than {MAX_MEMBERS} files")


class _Bounded(io.RawIOBase):
    """A member's stream that refuses to yield more than its declared size (a zip can lie)."""

    def __init__(self, f: IO[bytes], size: int) -> None:
        self._f, self._left = f, size

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        want = self._left + 1 if n < 0 else min(n, self._left + 1)
        data = self._f.read(want)
        if len(data) > self._left:
            raise ValueError("a member expands past its declared size")
        self._left -= len(data)
        return data


def _safe_name(name: str) -> str:
    if "\\" in name or "\x00" in name:
        raise ValueError(f"{name!r}: backslashes and NUL are not accepted in names")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise ValueError(f"{name!r} is an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        raise ValueError(f"{name!r} leaves the model directory")
    return posixpath.join(*parts)


def _check_member_kind(short: str, head: bytes) -> None:
    lower = short.lower()
    if lower.endswith(PICKLE_SUFFIXES):
        raise ValueError(
            f"{short} is a pickle format, which runs code when loaded: convert it to safetensors"
        )
    if lower.endswith(CODE_SUFFIXES):
        raise ValueError(f"{short} is code: remote code is never run")
    if pickle_protocol(head) is not None:
        raise ValueError(f"{short} is a pickle (by its first bytes): pickles are never loaded")
    if head.startswith((b"PK\x03\x04", b"\x1f\x8b")):
        raise ValueError(f"{short} is a nested archive (a torch checkpoint is one): not accepted")


def _json(archive: _Archive, short: str) -> dict[str, Any]:
    try:
        data = json.loads(archive.read(short, MAX_JSON_BYTES))
    except ValueError as exc:
        raise ValueError(f"{short} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{short} is not a JSON object")
    return data


def check_config(config: dict[str, Any]) -> str:
    """The config's ``model_type`` once it is one the platform builds without remote code."""
    if "auto_map" in config or config.get("trust_remote_code"):
        raise ValueError("config.json asks for remote code (auto_map): never run")
    if config.get("quantization_config"):
        raise ValueError("config.json: quantized checkpoints are not supported")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported; "
            f"use one of {sorted(SUPPORTED)}"
        )
    architectures = config.get("architectures") or [SUPPORTED[model_type]]
    if architectures != [SUPPORTED[model_type]]:
        raise ValueError(
            f"config.json: architectures {architectures!r}; a {model_type} model must be "
            f"{SUPPORTED[model_type]}"
        )
    return str(model_type)


def check_safetensors_header(short: str, f: _Bounded, size: int) -> int:
    """Check a safetensors file's header (dtypes, shapes, byte ranges) without reading its
    tensors; the number of parameters it holds."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{short}: not a safetensors file (too short)")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"{short}: not a safetensors file (bad header length)")
    try:
        header = json.loads(f.read(header_len))
    except ValueError:
        raise ValueError(f"{short}: not a safetensors file (the header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{short}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    body = size - 8 - header_len
    ranges, parameters = [], 0
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{short}: tensor {name!r} has no description")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"{short}: tensor {name!r} is {dtype}; use one of {sorted(SAFETENSORS_DTYPES)}"
            )
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{short}: tensor {name!r} has a bad shape {shape!r}")
        count = math.prod(shape)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or offsets[1] - offsets[0] != SAFETENSORS_DTYPES[dtype] * count
            or not 0 <= offsets[0] <= offsets[1] <= body
        ):
            raise ValueError(f"{short}: tensor {name!r} has bad data offsets {offsets!r}")
        ranges.append(offsets)
        parameters += count
    ranges.sort()
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:], strict=False)):
        raise ValueError(f"{short}: tensors overlap in the file")
    return parameters


def chat_environment() -> Any:
    """The Jinja environment chat templates render in: the immutable sandbox (a template is the
    uploader's code and reaches no Python object), with what transformers gives templates
    (``loopcontrols``, ``tojson`` keeping non-ASCII, ``raise_exception``, ``strftime_now``)."""
    from datetime import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the messages: {message}")

    def tojson(value: object, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def check_chat_template(template: object, where: str) -> None:
    if template is None:
        return
    if not isinstance(template, str):
        raise ValueError(f"{where}: chat_template must be one template string")
    from jinja2 import TemplateSyntaxError

    try:
        chat_environment().from_string(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{where}: the chat template does not compile: {exc}") from None


def _check(archive: _Archive) -> Manifest:
    members = archive.members
    for short in members:
        with archive.open(short) as f:
            _check_member_kind(short, f.read(8))
    for required in ("config.json", "tokenizer.json"):
        if required not in members:
            raise ValueError(f"the archive has no {required}")
    weights = sorted(n for n in members if n.endswith(".safetensors"))
    if not weights:
        raise ValueError("the archive has no *.safetensors weights")
    config = _json(archive, "config.json")
    model_type = check_config(config)
    parameters = 0
    for short in weights:
        with archive.open(short) as f:
            parameters += check_safetensors_header(short, f, members[short].size)
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(archive.read("tokenizer.json", MAX_TOKENIZER_BYTES).decode())
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own untyped errors
        raise ValueError(f"tokenizer.json does not load: {exc}") from None
    manifest = Manifest(model_type, config, weights, parameters=parameters)
    if "tokenizer_config.json" in members:
        manifest.tokenizer_config = _json(archive, "tokenizer_config.json")
        template = manifest.tokenizer_config.get("chat_template")
        check_chat_template(template, "tokenizer_config.json")
    if CHAT_TEMPLATE_FILE in members:
        template = archive.read(CHAT_TEMPLATE_FILE, MAX_JSON_BYTES).decode(errors="replace")
        check_chat_template(template, CHAT_TEMPLATE_FILE)
    if "generation_config.json" in members:
        manifest.generation_config = _json(archive, "generation_config.json")
    if WEIGHTS_INDEX in members:
        index = _json(archive, WEIGHTS_INDEX).get("weight_map")
        if not isinstance(index, dict) or not set(index.values()) <= set(weights):
            raise ValueError(f"{WEIGHTS_INDEX} names weight files the archive does not hold")
    return manifest


def check_archive(
    source: str | Path | IO[bytes], max_total: int = DEFAULT_MAX_TOTAL_BYTES
) -> Manifest:
    """Check an ``hf`` archive; ``ValueError`` says what is wrong."""
    archive = _Archive(source, max_total)
    try:
        return _check(archive)
    finally:
        archive.close()


def weight_files(
    source: str | Path | IO[bytes], max_total: int = DEFAULT_MAX_TOTAL_BYTES
) -> Iterator[tuple[str, IO[bytes]]]:
    """Each ``*.safetensors`` member of a checked archive as a stream, read once: the registry
    checks the weights' values at upload (``registry.weights``)."""
    archive = _Archive(source, max_total)
    try:
        for short in sorted(n for n in archive.members if n.endswith(".safetensors")):
            with archive.open(short) as f:
                yield short, cast(IO[bytes], f)
    finally:
        archive.close()


def extract(source: str | Path, dest: Path, max_total: int = DEFAULT_MAX_TOTAL_BYTES) -> Manifest:
    """Check the archive and write the files the agent loads into ``dest`` (flat; only names
    this module chose, so nothing lands outside it). A finished extraction is marked, so a
    crash halfway is redone."""
    archive = _Archive(source, max_total)
    try:
        manifest = _check(archive)
        dest.mkdir(parents=True, exist_ok=True)
        done = dest / ".complete"
        if done.exists():
            return manifest
        for short in [*manifest.weights, *(n for n in EXTRACTED if n in archive.members)]:
            target = dest / short
            with archive.open(short) as src, open(target, "wb") as out:
                while chunk := src.read(1024 * 1024):
                    out.write(chunk)
        done.touch()
        return manifest
    finally:
        archive.close()


def pack(model_dir: str | Path) -> bytes:
    """A ``.tar.gz`` archive of a saved model directory (``save_pretrained`` plus the tokenizer's
    files): what to upload as an ``hf`` version."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(Path(model_dir).iterdir()):
            if path.is_file() and (path.name in EXTRACTED or path.suffix == ".safetensors"):
                tar.add(path, arcname=path.name)
    return buffer.getvalue()
