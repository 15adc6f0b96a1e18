"""Writing a ``python`` model (``docs/custom-code.md``): the errors a model raises, the partial
answer of a batch where some rows failed, and the worker that runs a package's class.

The agent copies this file (and the package's ``__init__``) into every environment it builds
for a package, and runs ``python -m switchyard_client.model --fd N`` in a sandboxed process;
``switchyard push`` runs ``--smoke DIR`` on the author's machine before uploading. Standard
library and numpy only: it must run in any environment a package brings.

The wire between agent and worker is a Unix socket: each message is a 4-byte big-endian length,
then a 4-byte header length, a JSON header and the raw tensor buffers the header lists. BYTES
tensors are each element's 4-byte little-endian length then its bytes (Triton's layout).

A package whose class generates text (``generate(prompt, parameters)`` yielding strings; the
``python_generator`` format) is loaded with ``"generates": true``, and the worker then serves
streams (``serve_streams``): ``generate`` and ``cancel`` messages in, and one ``step`` message out
per round, in which every live generator has been advanced once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import select
import socket
import struct
import sys
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
_LENGTH = struct.Struct(">I")
_ITEM = struct.Struct("<I")


class InvalidInput(ValueError):
    """Raise it for input the model cannot take: the caller gets a 400 with its message."""


class Partial:
    """A batch answer where some rows failed: ``outputs`` for every row (any value in a failed
    row), ``errors`` {row index in the batch: message}. The requests holding a failed row get
    a 400 with its message; the others their rows."""

    def __init__(self, outputs: Any, errors: Mapping[int, str]) -> None:
        self.outputs = outputs
        self.errors = {int(row): str(message) for row, message in errors.items()}


# Tensors on the wire ---------------------------------------------------------------------


def encode_tensor(name: str, datatype: str, array: np.ndarray) -> tuple[dict[str, Any], bytes]:
    if datatype == "BYTES":
        parts: list[bytes] = []
        for item in array.reshape(-1):
            raw = item.encode() if isinstance(item, str) else bytes(item)
            parts.append(_ITEM.pack(len(raw)) + raw)
        data = b"".join(parts)
    else:
        data = np.ascontiguousarray(array, dtype=DTYPES[datatype]).tobytes()
    meta = {"name": name, "datatype": datatype, "shape": list(array.shape), "nbytes": len(data)}
    return meta, data


def decode_tensor(meta: Mapping[str, Any], data: memoryview) -> np.ndarray:
    """A tensor from its header entry and buffer; ``ValueError`` when they disagree."""
    datatype, shape = meta["datatype"], meta["shape"]
    if datatype not in DTYPES or not isinstance(shape, list) or len(shape) > 16:
        raise ValueError(f"bad tensor header {dict(meta)!r:.200}")
    if not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
        raise ValueError(f"bad shape {shape!r:.200}")
    count = math.prod(shape)  # np.prod costs ~4.5 us a call, on both sides of every batch
    if datatype != "BYTES":
        dtype = np.dtype(DTYPES[datatype])
        if count * dtype.itemsize != len(data):
            raise ValueError(f"{meta.get('name')}: {len(data)} bytes for shape {shape}")
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    items = np.empty(count, dtype=object)
    offset = 0
    for i in range(count):
        if offset + 4 > len(data):
            raise ValueError(f"{meta.get('name')}: BYTES buffer ends early")
        (length,) = _ITEM.unpack_from(data, offset)
        offset += 4
        if offset + length > len(data):
            raise ValueError(f"{meta.get('name')}: BYTES item runs past the buffer")
        items[i] = bytes(data[offset : offset + length])
        offset += length
    if offset != len(data):
        raise ValueError(f"{meta.get('name')}: {len(data) - offset} bytes after the last item")
    return items.reshape(shape)


def pack(header: dict[str, Any], buffers: Sequence[bytes] = ()) -> bytes:
    head = json.dumps(header).encode()
    body = _LENGTH.pack(len(head)) + head + b"".join(buffers)
    return _LENGTH.pack(len(body)) + body


def unpack(body: bytes, max_header: int = 1 << 20) -> tuple[dict[str, Any], memoryview]:
    """A message's header and its buffers (one view, split by the header's ``nbytes``)."""
    if len(body) < 4:
        raise ValueError("message shorter than its header length")
    (head_len,) = _LENGTH.unpack_from(body)
    if head_len > max_header or 4 + head_len > len(body):
        raise ValueError("header length out of bounds")
    header = json.loads(body[4 : 4 + head_len])
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    return header, memoryview(body)[4 + head_len :]


def split_tensors(metas: Any, buffers: memoryview, limit: int = 64) -> list[np.ndarray]:
    if not isinstance(metas, list) or len(metas) > limit:
        raise ValueError("tensors must be a list")
    arrays, offset = [], 0
    for meta in metas:
        if not isinstance(meta, dict) or not isinstance(meta.get("nbytes"), int):
            raise ValueError("bad tensor header")
        end = offset + meta["nbytes"]
        if meta["nbytes"] < 0 or end > len(buffers):
            raise ValueError("tensor buffers are shorter than their headers say")
        arrays.append(decode_tensor(meta, buffers[offset:end]))
        offset = end
    if offset != len(buffers):
        raise ValueError("bytes after the last tensor")
    return arrays


# Running the package's class -------------------------------------------------------------


class Handler:
    """The package's class, loaded: ``__call__`` runs one batch through ``preprocess`` (if it
    has one), ``predict`` and ``postprocess`` (if it has one) and returns the declared outputs
    in order, with {row: error} for the rows that failed."""

    def __init__(
        self,
        package_dir: Path,
        entrypoint: str,
        outputs: list[dict[str, Any]],
        generates: bool = False,
    ):
        sys.path.insert(0, str(package_dir))
        module_name, cls_name = entrypoint.split(":")
        cls = getattr(importlib.import_module(module_name), cls_name)
        self.model = cls()
        for name in ("generate",) if generates else ("predict",):
            if not callable(getattr(self.model, name, None)):
                raise TypeError(f"{entrypoint} has no {name}() method")
        self.outputs = outputs
        load = getattr(self.model, "load", None)
        if callable(load):
            load()

    def __call__(self, batch: dict[str, np.ndarray]) -> tuple[list[np.ndarray], dict[int, str]]:
        value: Any = batch
        pre = getattr(self.model, "preprocess", None)
        if callable(pre):
            value = pre(value)
        value = self.model.predict(value)
        post = getattr(self.model, "postprocess", None)
        if callable(post):
            value = post(value)
        errors: dict[int, str] = {}
        if isinstance(value, Partial):
            value, errors = value.outputs, value.errors
        return self._outputs(value), errors

    def generate(self, prompt: str, parameters: dict[str, Any]) -> Iterator[str]:
        """The class's generator for one stream (``generates = true`` packages)."""
        value = self.model.generate(prompt, parameters)
        if isinstance(value, str | bytes) or not hasattr(value, "__next__"):
            raise TypeError(
                f"generate() must return an iterator of str (a generator), not "
                f"{type(value).__name__}"
            )
        return value

    def _outputs(self, value: Any) -> list[np.ndarray]:
        names = [o["name"] for o in self.outputs]
        if isinstance(value, Mapping):
            missing = [n for n in names if n not in value]
            if missing:
                raise TypeError(f"the model's answer lacks the declared outputs {missing}")
            values = [value[n] for n in names]
        elif isinstance(value, list | tuple) and len(names) > 1:
            if len(value) != len(names):
                raise TypeError(f"the model answered {len(value)} outputs, declared {names}")
            values = list(value)
        else:
            values = [value]
        arrays = []
        for spec, item in zip(self.outputs, values, strict=True):
            if spec["datatype"] == "BYTES":
                array = np.asarray(item, dtype=object)
            else:
                array = np.asarray(item, dtype=DTYPES[spec["datatype"]])
            arrays.append(array)
        return arrays


def _error(request_id: int, exc: BaseException) -> bytes:
    code = "bad_input" if isinstance(exc, InvalidInput) else "internal"
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    message = f"{type(exc).__name__}: {exc}"[:1000] + at
    return pack({"id": request_id, "ok": False, "code": code, "message": message})


def read_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """``n`` bytes from the socket, or None when it closes first; past ``deadline``
    (``time.monotonic()``) ``TimeoutError``, however the bytes trickle in."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def serve(sock: socket.socket) -> None:
    """Answer the agent's messages until it closes the socket: first ``load``, then
    ``predict`` batches, one at a time (or, for a generating package, ``serve_streams``)."""
    handler: Handler | None = None
    while True:
        raw = read_exactly(sock, 4)
        if raw is None:
            return
        body = read_exactly(sock, _LENGTH.unpack(raw)[0])
        if body is None:
            return
        header, buffers = unpack(body)
        request_id = int(header.get("id", 0))
        try:
            if header["op"] == "load":
                generates = header.get("generates") is True
                handler = Handler(
                    Path(header["package"]), header["entrypoint"], header["outputs"], generates
                )
                if generates:
                    sock.settimeout(None)
                    sock.sendall(pack({"id": request_id, "ok": True}))
                    serve_streams(sock, handler)
                    return
                reply = pack({"id": request_id, "ok": True})
            elif header["op"] == "predict" and handler is not None:
                arrays = split_tensors(header["inputs"], buffers)
                batch = {m["name"]: a for m, a in zip(header["inputs"], arrays, strict=True)}
                outputs, errors = handler(batch)
                encoded = [
                    encode_tensor(spec["name"], spec["datatype"], array)
                    for spec, array in zip(handler.outputs, outputs, strict=True)
                ]
                reply = pack(
                    {
                        "id": request_id,
                        "ok": True,
                        "outputs": [m for m, _ in encoded],
                        "errors": {str(k): v for k, v in errors.items()},
                    },
                    [data for _, data in encoded],
                )
            else:
                raise RuntimeError(f"unexpected message {header.get('op')!r}")
        except Exception as exc:  # noqa: BLE001 - the model's failure is the request's answer
            reply = _error(request_id, exc)
        sock.sendall(reply)


# Streaming a generating package's text -------------------------------------------------


class Inbox:
    """The agent's messages, read without blocking while streams are live: ``read`` takes
    what has arrived (waiting for something only when ``block``) and returns the complete
    messages' headers, or None once the agent has closed the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.closed = False

    def read(self, block: bool) -> list[dict[str, Any]] | None:
        if not self.closed:
            wait: float | None = None if block else 0.0
            while select.select([self.sock], [], [], wait)[0]:
                try:
                    chunk = self.sock.recv(1 << 20)
                except OSError:  # reset: the agent is gone
                    chunk = b""
                if not chunk:
                    self.closed = True
                    break
                self.buffer += chunk
                wait = 0.0  # then take whatever else is there, without waiting
        messages = []
        while len(self.buffer) >= 4:
            (length,) = _LENGTH.unpack_from(self.buffer)
            if len(self.buffer) < 4 + length:
                break
            body = bytes(self.buffer[4 : 4 + length])
            del self.buffer[: 4 + length]
            messages.append(unpack(body)[0])
        if not messages and self.closed:
            return None
        return messages


def _stream_error(stream_id: int, exc: BaseException) -> dict[str, Any]:
    code = "bad_input" if isinstance(exc, InvalidInput) else "internal"
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" (at {Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    return {"id": stream_id, "error": f"{type(exc).__name__}: {exc}"[:1000] + at, "code": code}


def _close(generator: Iterator[str]) -> None:
    close = getattr(generator, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - a generator that fails to close is gone anyway
            pass


def serve_streams(sock: socket.socket, handler: Handler) -> None:
    """Run every live stream's generator together, like continuous batching: each round reads
    the agent's new messages (``generate``: start a stream; ``cancel``: close its generator),
    without waiting while streams are live, then advances every live generator by one item
    and sends the round's events in one ``step`` message: ``{"id", "text"}`` for an item,
    ``{"id", "end": true}`` for a generator that returned, ``{"id", "error", "code"}`` for one
    that raised, ``{"id", "cancelled": true}`` for each cancel received. The agent enforces
    stops, lengths and timeouts; this only runs the code."""
    inbox = Inbox(sock)
    live: dict[int, Iterator[str]] = {}
    while True:
        messages = inbox.read(block=not live)
        if messages is None:
            break
        events: list[dict[str, Any]] = []
        for message in messages:
            stream_id = message.get("id")
            if not isinstance(stream_id, int):
                continue
            if message.get("op") == "generate":
                try:
                    live[stream_id] = handler.generate(
                        str(message.get("prompt", "")), dict(message.get("parameters") or {})
                    )
                except Exception as exc:  # noqa: BLE001 - the stream's answer
                    events.append(_stream_error(stream_id, exc))
            elif message.get("op") == "cancel":  # acknowledged, whether it was live or not
                cancelled = live.pop(stream_id, None)
                if cancelled is not None:
                    _close(cancelled)
                events.append({"id": stream_id, "cancelled": True})
        for stream_id, generator in list(live.items()):
            try:
                item = next(generator)
                if not isinstance(item, str):
                    raise TypeError(f"generate() yielded {type(item).__name__}, not str")
            except StopIteration:
                del live[stream_id]
                events.append({"id": stream_id, "end": True})
            except Exception as exc:  # noqa: BLE001 - the stream's answer
                del live[stream_id]
                _close(generator)
                events.append(_stream_error(stream_id, exc))
            else:
                events.append({"id": stream_id, "text": item})
        if events:
            try:
                sock.sendall(pack({"op": "step", "events": events}))
            except OSError:  # the agent is gone
                break
    for generator in live.values():
        _close(generator)


# Trying a package on the author's machine ------------------------------------------------


def smoke(package_dir: Path) -> dict[str, Any]:
    """Import the package's class, ``load()`` it and run one row of zeros (empty strings for
    BYTES) through it; the outputs' names, types and rows must be the declared ones. Returns
    what each output looked like; raises with what is wrong."""
    import tomllib

    manifest = tomllib.loads((package_dir / "switchyard.toml").read_text())
    if manifest["model"].get("generates") is True:
        return smoke_generator(package_dir, manifest["model"]["entrypoint"])
    handler = Handler(package_dir, manifest["model"]["entrypoint"], manifest["outputs"])
    batch = {}
    for spec in manifest["inputs"]:
        shape = [1 if d == -1 else d for d in spec["shape"]]
        if spec["datatype"] == "BYTES":
            batch[spec["name"]] = np.full(shape, b"", dtype=object)
        else:
            batch[spec["name"]] = np.zeros(shape, dtype=DTYPES[spec["datatype"]])
    outputs, errors = handler(batch)
    seen = {}
    for spec, array in zip(manifest["outputs"], outputs, strict=True):
        if array.ndim == 0 or array.shape[0] != 1:
            raise ValueError(f"output {spec['name']}: shape {list(array.shape)}, expected 1 row")
        encode_tensor(spec["name"], spec["datatype"], array)  # its type converts
        seen[spec["name"]] = {"datatype": spec["datatype"], "shape": list(array.shape)}
    return {"outputs": seen, "row_errors": errors}


SMOKE_PARAMETERS = {
    "max_new_tokens": 4,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "stop": [],
    "seed": 0,
}


def smoke_generator(package_dir: Path, entrypoint: str) -> dict[str, Any]:
    """A generating package's check: ``load()``, then up to 4 items of ``generate("Hello",
    ...)``, each of which must be a str (reported as a ``text`` output of that many rows)."""
    handler = Handler(package_dir, entrypoint, [], generates=True)
    generator = handler.generate("Hello", dict(SMOKE_PARAMETERS))
    texts: list[str] = []
    for item in generator:
        if not isinstance(item, str):
            raise TypeError(f"generate() yielded {type(item).__name__}, not str")
        texts.append(item)
        if len(texts) == SMOKE_PARAMETERS["max_new_tokens"]:
            _close(generator)
            break
    return {"outputs": {"text": {"datatype": "BYTES", "shape": [len(texts)]}}, "generated": texts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchyard_client.model")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--fd", type=int, help="serve the agent on this socket")
    group.add_argument("--smoke", type=Path, help="try the package in this folder once")
    args = parser.parse_args(argv)
    if args.smoke is not None:
        try:
            print(json.dumps(smoke(args.smoke.resolve())))
        except Exception as exc:  # noqa: BLE001 - reported to the author, with where
            traceback.print_exc()
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            return 1
        return 0
    sock = socket.socket(fileno=args.fd)
    os.set_inheritable(args.fd, False)
    serve(sock)
    return 0


if __name__ == "__main__":
    # The package imports ``switchyard_client.model`` for InvalidInput and Partial: make that
    # this module, not a second copy whose classes the worker would not recognise.
    sys.modules.setdefault("switchyard_client.model", sys.modules[__name__])
    raise SystemExit(main())
