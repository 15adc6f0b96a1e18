"""The data path's error: a status and a message that names the problem, which every front
door renders in its own protocol's shape. The bottom of the gateway: the codecs, the checks and
the pipeline all raise it, and it imports none of them."""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, field

from .dispatch import DispatchError


@dataclass
class ApiError(Exception):
    status: int
    message: str
    headers: list[tuple[str, str]] = field(default_factory=list)


def api_error(exc: DispatchError) -> ApiError:
    """A dispatch failure (no agent, shed, timed out) as the front doors answer it."""
    retry = [("Retry-After", str(exc.retry_after))] if exc.retry_after else []
    return ApiError(exc.status, exc.message, retry)


# How an error message quotes a value the caller sent: short, and safe at any depth (the repr
# of a list nested 1,000 deep, which a JSON body may hold, raises RecursionError).
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother = 2, 60, 60


def shown(value: object) -> str:
    """``value`` as an error message quotes it (a bounded repr)."""
    return _QUOTE.repr(value)


_ASCII_INT = re.compile(r"[0-9]{1,18}")


def ascii_int(text: str) -> int | None:
    """A non-negative integer written in ASCII digits (as HTTP headers and URLs write them),
    else None. ``str.isdigit`` is no test: it accepts "²", which ``int`` refuses, and a string
    of thousands of digits, which ``int`` refuses too (and would be no length anyway)."""
    return int(text) if _ASCII_INT.fullmatch(text) else None
