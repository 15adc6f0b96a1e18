"""Reading a request and writing a JSON reply in raw ASGI, shared by the lean apps that skip
Django's request stack (OIP v2 in ``gateway.oip``, the prediction API in
``gateway.api.predict_app``), so both enforce the same body limit the same way."""

from __future__ import annotations

import orjson

from .asgi_types import Receive, Scope, Send
from .errors import ApiError, ascii_int
from .http_bounds import BodyDeadline


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (``name`` in lower case, as ASGI gives them)."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, or 413 as soon as it (or its declared length) passes ``limit`` bytes:
    a body too large is never held in memory whole; or 408 (and the connection closed) when
    it stops arriving, or arrives too slowly (``http_bounds.BodyDeadline``)."""
    declared = header(scope, b"content-length")
    if declared is not None:
        length = ascii_int(declared.strip())
        if length is None:
            raise ApiError(400, "Content-Length: must be a number of bytes in ASCII digits")
        if length > limit:
            raise ApiError(413, f"request body is larger than the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    deadline = BodyDeadline()
    while True:
        message = await deadline.read(receive)
        if message is None:
            raise ApiError(408, deadline.late, [("Connection", "close")])
        if message["type"] == "http.disconnect":
            raise ApiError(400, "client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def error_body(message: str) -> bytes:
    """The data path's error shape: ``{"error": "<what is wrong>"}``."""
    try:
        return orjson.dumps({"error": message})
    except orjson.JSONEncodeError:  # it quotes a lone surrogate the caller sent: escape it
        return orjson.dumps({"error": message.encode("utf-8", "backslashreplace").decode()})


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
    """Send a whole reply; JSON unless ``headers`` name another content type."""
    raw_headers = [(b"content-length", str(len(body)).encode())]
    if not any(k.lower() == "content-type" for k, _ in headers):
        raw_headers.append((b"content-type", b"application/json"))
    raw_headers.extend((k.lower().encode(), v.encode()) for k, v in headers)
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
