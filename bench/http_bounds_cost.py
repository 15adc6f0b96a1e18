"""CPU cost per request of the body bounds in ``gateway.http_bounds``, on one event loop:
``BodyDeadline.read`` (each body read of the lean OIP v2, prediction API and embeddings apps,
the hot path: the gap timeout and the whole body's deadline) against a bare ``receive()`` and
against ``read_within`` alone (the gap timeout, what the lean apps did before), and
``bound_body_reads`` (around Django's app) against a trivial ASGI app that reads a whole small
body and answers.

    .venv/bin/python bench/http_bounds_cost.py
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path.cwd()))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402

from gateway.http_bounds import BodyDeadline, bound_body_reads, read_within  # noqa: E402

N = 200_000
SCOPE = {"type": "http", "path": "/v2/models/m/infer", "headers": [(b"content-length", b"64")]}
BODY = {"type": "http.request", "body": b"x" * 64, "more_body": False}


async def receive() -> dict[str, Any]:
    return BODY


async def send(message: Any) -> None:
    pass


async def app(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def per_call(target: Any) -> float:
    started = time.perf_counter()
    for _ in range(N):
        await target(SCOPE, receive, send)
    return (time.perf_counter() - started) / N * 1e6


async def timed_app(scope: Any, receive: Any, send: Any) -> None:
    await BodyDeadline().read(receive)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def gap_only_app(scope: Any, receive: Any, send: Any) -> None:
    await read_within(receive, settings.SWITCHYARD_BODY_TIMEOUT_S)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def best(target: Any) -> float:
    await per_call(target)  # warm up
    return min([await per_call(target) for _ in range(3)])


async def main() -> None:
    bare, gap_only = await best(app), await best(gap_only_app)
    timed, wrapped = await best(timed_app), await best(bound_body_reads(app))
    print(f"bare app: {bare:.2f} µs/request")
    print(f"read_within alone (the gap timeout): {gap_only:.2f} µs (+{gap_only - bare:.2f})")
    print(f"BodyDeadline.read (OIP, prediction API): {timed:.2f} µs (+{timed - bare:.2f})")
    print(f"bound_body_reads (Django): {wrapped:.2f} µs (+{wrapped - bare:.2f})")


asyncio.run(main())
