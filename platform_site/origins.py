"""Which web pages may open a websocket that rides on the signed-in session's cookie.

A browser sends the cookie with any page's websocket, whatever site the page is on, so such a
socket must check the page's ``Origin`` itself (Django's CSRF check covers forms, not sockets).
The rule is Django's CSRF origin check (``CsrfViewMiddleware._origin_verified``), so a page
that may post a form may open a socket, and no other: the Origin must equal the scheme, host
and port the socket was opened on (the ``Host`` header, itself one of ``ALLOWED_HOSTS``), or be
one of ``CSRF_TRUSTED_ORIGINS`` (``https://*.example.com`` for its subdomains). Channels'
``AllowedHostsOriginValidator`` compared the host alone, so a page on any other port of an
allowed host (another service on the same machine) could use a user's session.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host
from django.utils.http import is_same_domain

Scope = dict[str, Any]
App = Any  # an ASGI application: (scope, receive, send) -> None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key == name:
            return value.decode("latin-1")
    return None


def same_origin(scope: Scope) -> bool:
    """Whether the socket's ``Origin`` is this site as the browser reached it, or a trusted
    origin. No Origin is refused: browsers always send one, and only a browser carries a
    user's cookie without being told to."""
    origin = _header(scope, b"origin")
    if not origin:
        return False
    host = _header(scope, b"host") or ""
    if validate_host(split_domain_port(host)[0], settings.ALLOWED_HOSTS):
        # uvicorn says "wss" behind a TLS proxy whose X-Forwarded-Proto it trusts, as Django's
        # request.is_secure() then says True.
        scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
        if origin == f"{scheme}://{host}":
            return True
    trusted = settings.CSRF_TRUSTED_ORIGINS
    if origin in [t for t in trusted if "*" not in t]:
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:  # malformed (an unclosed IPv6 bracket)
        return False
    for pattern in (urlsplit(t) for t in trusted if "*" in t):  # https://*.example.com
        subdomains_of = pattern.netloc.lstrip("*")
        if parts.scheme == pattern.scheme and is_same_domain(parts.netloc, subdomains_of):
            return True
    return False


def same_origin_only(app: App) -> App:
    """Wrap a websocket route: a handshake whose Origin ``same_origin`` refuses is closed
    before it is accepted (the browser sees 403), as Channels' ``OriginValidator`` does."""

    async def validated(scope: Scope, receive: Any, send: Any) -> None:
        if same_origin(scope):
            await app(scope, receive, send)
        else:
            await WebsocketDenier()(scope, receive, send)

    return validated
