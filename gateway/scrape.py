"""``GET /metrics`` for Prometheus, as a lean ASGI app (no Django request stack)."""

from __future__ import annotations

import hmac

from channels.db import database_sync_to_async
from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST

from platform_site.tokens import bearer

from .asgi_types import Receive, Scope, Send
from .metrics import exposition, fold_dispatched
from .state import get_state


async def metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /metrics`` as a lean ASGI app. Scrapers send the install's metrics token as a
    bearer token (metrics name tenants and models), unless ``SWITCHYARD_METRICS_PUBLIC`` is
    on (then the token setting is empty)."""
    headers = dict(scope["headers"])
    token = settings.SWITCHYARD_METRICS_TOKEN
    if scope["method"] not in ("GET", "HEAD"):
        status, body, content_type = 405, b'{"error": "use GET"}', b"application/json"
    elif token and not hmac.compare_digest(
        bearer(headers.get(b"authorization", b"").decode("latin-1")) or "", token
    ):
        status, content_type = 401, b"application/json"
        body = (
            b'{"error": "metrics need a bearer token: SWITCHYARD_METRICS_TOKEN, or the file '
            b'var/metrics-token that the platform generated"}'
        )
    else:
        state = get_state()
        state.metrics.fold()  # this process's latest counts; others fold every 0.5 s
        fold_dispatched(state.pool.dispatched)
        status, content_type = 200, CONTENT_TYPE_LATEST.encode()
        body = await database_sync_to_async(exposition)()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                *([(b"www-authenticate", b"Bearer")] if status == 401 else []),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
