import sys

from django.conf import settings
from django.contrib import admin
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.views.defaults import bad_request as django_bad_request
from django.views.defaults import page_not_found
from django.views.defaults import server_error as django_server_error
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from gateway import openai_api
from platform_site.db_outage import unavailable
from platform_site.postgres import DatabaseUnavailable
from tenants import schema  # noqa: F401  (registers the OpenAPI auth extension for /api/schema/)

# Each API answers its errors in its own shape, even the ones Django raises before a view runs
# (no such URL, a body past DATA_UPLOAD_MAX_MEMORY_SIZE, a bad Host): OpenAI clients read
# OpenAI's shape under /v1/, the API's shape under /api/; only the pages get Django's HTML.


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    message = f"no such endpoint: {request.path}"
    if request.path.startswith("/v1/"):
        return openai_api.openai_error(404, message)
    if request.path.startswith("/api/"):
        return JsonResponse({"error": message}, status=404)
    return page_not_found(request, exception)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    status, message = 400, "bad request"
    if isinstance(exception, RequestDataTooBig):
        status, message = 413, "the body is larger than the server accepts"
    if request.path.startswith("/v1/"):
        return openai_api.openai_error(status, message)
    if request.path.startswith("/api/"):
        return JsonResponse({"error": message}, status=status)
    return django_bad_request(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    exc = sys.exc_info()[1]  # Django calls this while handling the exception
    if isinstance(exc, DatabaseUnavailable):  # raised outside a view: a middleware's query
        return unavailable(request, exc)
    if request.path.startswith("/v1/"):
        return openai_api.openai_error(500, "internal server error")
    if request.path.startswith("/api/"):
        return JsonResponse({"error": "internal server error"}, status=500)
    return django_server_error(request)


urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("gateway.api.urls")),
    path("api/v1/", include("registry.api.urls")),
    path("api/v1/", include("monitoring.api.urls")),
    path("api/v1/", include("rollouts.api.urls")),
    path("api/v1/", include("tenants.api.urls")),
    path("api/v1/", include("fleet.api.urls")),
    path("api/v1/", include("batch.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    # OpenAI-compatible text generation (base URL http://HOST/v1 for OpenAI clients).
    path("v1/completions", openai_api.completions),
    path("v1/chat/completions", openai_api.chat_completions),
    path("v1/models", openai_api.models),
    path("", include("web.urls")),
]
if settings.SSO_ENABLED:
    urlpatterns += [path("oidc/", include("mozilla_django_oidc.urls"))]

handler400 = bad_request
handler404 = not_found
handler500 = server_error
