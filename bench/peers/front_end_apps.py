"""The smallest HTTP apps that do a gateway's I/O for one request (read a JSON body, answer a
JSON body of an OIP reply's size) on each interface ``bench/front_end_probe.py`` compares: the
cost of the front end alone, with no platform work in it. Not imported by the platform."""

from __future__ import annotations

from typing import Any

REPLY = (
    b'{"model_name":"fraud-detector","model_version":"1","id":"0123456789abcdef",'
    b'"outputs":[{"name":"probabilities","datatype":"FP32","shape":[1,2],'
    b'"data":[0.9712345,0.0287655]}]}'
)
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(REPLY)).encode())]


async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app (uvicorn, granian's ASGI interface)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": REPLY})


async def rsgi(scope: Any, protocol: Any) -> None:
    """An RSGI app (granian's own interface: the body in one call, the reply in one)."""
    await protocol()
    protocol.response_bytes(200, [("content-type", "application/json")], REPLY)
