"""BYTES tensors at the front doors (KServe/Triton semantics): each element a ``bytes`` in a numpy
object array; in JSON a (nested) list of strings, in Triton's binary extension and gRPC's raw
contents each element behind a 4-byte little-endian length. Bounded per element and per tensor;
a text input (a version with a tokenizer) must also be valid UTF-8.

Errors are ``BytesError`` with the problem; the codecs add where it was and answer 400.
"""

from __future__ import annotations

import numpy as np
from django.conf import settings

from serving_agent.protocol import pack_bytes, unpack_bytes


class BytesError(ValueError):
    """A BYTES tensor the platform refuses; the message says why."""


def from_json(data: object) -> np.ndarray:
    """A flat object array of UTF-8 ``bytes`` from JSON ``data``: strings, nested lists allowed
    (as KServe's row-major form)."""
    if not isinstance(data, list):
        raise BytesError("must be a list of strings")
    out: list[bytes] = []
    # A stack instead of recursion: a hostile nesting depth cannot exhaust Python's.
    stack: list[object] = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item.encode())
        elif isinstance(item, list):
            stack.extend(reversed(item))
        else:
            raise BytesError(f"BYTES values must be strings (got {type(item).__name__})")
    array = np.empty(len(out), dtype=object)
    array[:] = out
    return array


def from_buffer(buffer: bytes | memoryview, count: int) -> np.ndarray:
    """``count`` length-prefixed elements that must fill ``buffer`` exactly."""
    try:
        array, end = unpack_bytes(buffer, 0, count, len(buffer))
    except ValueError as exc:
        raise BytesError(f"length-prefixed elements do not fit: {exc}") from None
    if end != len(buffer):
        raise BytesError(
            f"{len(buffer) - end} bytes follow the {count} length-prefixed elements the shape holds"
        )
    return array


def check(array: np.ndarray, text: bool) -> None:
    """Refuse elements past the size limits and, for a text input, invalid UTF-8."""
    largest = settings.SWITCHYARD_MAX_BYTES_ELEMENT
    total = 0
    for i, value in enumerate(array.reshape(-1).tolist()):
        if not isinstance(value, bytes):
            raise BytesError(f"element {i} is not bytes")
        if len(value) > largest:
            raise BytesError(f"element {i} has {len(value)} bytes; the limit is {largest}")
        total += len(value)
        if text:
            try:
                value.decode()
            except UnicodeDecodeError as exc:
                raise BytesError(f"element {i} is not valid UTF-8 text ({exc.reason})") from None
    if total > settings.SWITCHYARD_MAX_BYTES_TENSOR:
        raise BytesError(
            f"holds {total} bytes; the limit is {settings.SWITCHYARD_MAX_BYTES_TENSOR}"
        )


def to_json(array: np.ndarray) -> list[str]:
    """A BYTES output as JSON strings (flat, row-major). Bytes that are not UTF-8 are shown
    with U+FFFD: JSON has no bytes; binary outputs carry them unchanged."""
    return [
        v.decode(errors="replace") if isinstance(v, bytes) else str(v)
        for v in array.reshape(-1).tolist()
    ]


def to_buffer(array: np.ndarray) -> bytes:
    return pack_bytes(array)
