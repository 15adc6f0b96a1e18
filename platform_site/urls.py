from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.views.defaults import page_not_found
from django.views.defaults import server_error as django_server_error
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from gateway import openai_api


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if request.path.startswith(("/api/", "/v1/")):
        return JsonResponse({"error": f"no such endpoint: {request.path}"}, status=404)
    return page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
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
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    # OpenAI-compatible text generation (base URL http://HOST/v1 for OpenAI clients).
    path("v1/completions", openai_api.completions),
    path("v1/chat/completions", openai_api.chat_completions),
    path("v1/models", openai_api.models),
    path("", include("web.urls")),
]

handler404 = not_found
handler500 = server_error
