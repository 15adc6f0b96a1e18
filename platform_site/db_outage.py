"""What the control plane answers while its database is unreachable: 503 with ``Retry-After``
in each protocol's shape (the API's JSON error, OpenAI's, a small HTML page for the web UI and
the admin), never a 500 with a traceback.

``DatabaseUnavailable`` (``platform_site.postgres``: a connect failed, or the circuit is open
and nothing was tried) is answered where it surfaces: the DRF views through the API's exception
handler (``platform_site.errors``), the other views here (``DatabaseOutageMiddleware``), and a
middleware's own query (a session saved, an ``Idempotency-Key`` claimed) by the 500 handler
(``platform_site.urls.server_error``), which Django calls with the exception at hand (with
``DEBUG`` on, Django shows its debug page there instead).
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.deprecation import MiddlewareMixin

from gateway.openai_api import openai_error
from platform_site.postgres import DatabaseUnavailable

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Switchyard is unavailable</title></head>
<body><h1>Temporarily unavailable</h1>
<p>Switchyard cannot reach its database right now. Try again in {retry_after} s.</p>
</body></html>
"""


def unavailable(request: HttpRequest, exc: DatabaseUnavailable) -> HttpResponse:
    retry = ("Retry-After", str(exc.retry_after_s))
    if request.path.startswith("/v1/"):
        return openai_error(503, str(exc), [retry])
    if request.path.startswith("/api/"):
        return JsonResponse({"error": str(exc)}, status=503, headers=dict([retry]))
    page = PAGE.format(retry_after=exc.retry_after_s)
    return HttpResponse(page, status=503, headers=dict([retry]))


class DatabaseOutageMiddleware(MiddlewareMixin):
    """A view's ``DatabaseUnavailable`` answered as 503 (costs nothing on other requests: only
    ``process_exception``, which Django calls when a view raises)."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, DatabaseUnavailable):
            return unavailable(request, exception)
        return None
