"""The admin page that shows a new API key or node token once, in the response itself.

Django's messages framework would carry the secret in a cookie (``messages``) until the next
page read it, and any session store would keep it on the server; this page is rendered from
the request that made the secret, marked not to be cached, and the secret is gone with it.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from django.contrib import admin
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.cache import add_never_cache_headers

# A secret made while handling a request, kept only until that request's response renders it
# (save_model makes it, response_add shows it): a weak key, so it never outlives the request.
made: WeakKeyDictionary[HttpRequest, list[tuple[str, str]]] = WeakKeyDictionary()


def remember(request: HttpRequest, label: str, secret: str) -> None:
    made.setdefault(request, []).append((label, secret))


def shown_once_page(
    request: HttpRequest, title: str, what: str, next_url: str
) -> TemplateResponse | None:
    """The page showing the secrets this request made, or None when it made none."""
    shown = made.pop(request, None)
    if not shown:
        return None
    context = {
        **admin.site.each_context(request),
        "title": title,
        "what": what,
        "shown": shown,
        "next_url": next_url,
    }
    response = TemplateResponse(request, "admin/shown_once.html", context)
    add_never_cache_headers(response)
    return response
