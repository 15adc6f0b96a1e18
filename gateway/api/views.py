"""The prediction API's view: its entry in the OpenAPI schema, and the answer to requests
that reach Django. Over HTTP, ``POST`` to these URLs is served before Django by the lean app in
``gateway/api/predict_app.py``; both answer with the same function (``predict_app.answer``)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants.authentication import ApiKeyAuthentication

from ..errors import ApiError
from ..state import get_state
from .predict_app import PredictURL, answer
from .serializers import ErrorResponse, PredictRequest, PredictResponse


def _error(description: str) -> OpenApiResponse:
    return OpenApiResponse(ErrorResponse, description=description)


class PredictView(APIView):
    """``POST /api/v1/models/{name}/predict`` (and ``/versions/{v}/predict``, ``{v}`` a version
    number or an alias name)."""

    # Named for the schema (a Bearer API key); ``answer`` authenticates through the pipeline's
    # in-process key cache, so DRF's own authentication never runs here.
    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [AllowAny]

    # Its Idempotency-Key is the data path's (gateway.idempotency, in ``answer``), kept off the
    # database, not the control plane's (tenants.middleware).
    idempotency_in_view = True

    def perform_authentication(self, request: Request) -> None:
        pass  # see authentication_classes

    # Async on purpose (Django awaits it, as its handlers are coroutines); the stubs know only
    # a sync dispatch.
    async def dispatch(  # type: ignore[override]
        self, request: HttpRequest, *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        if request.method == "POST":
            return await self.predict(request, kwargs["name"], kwargs.get("version"))
        # Other methods (OPTIONS, and GET's 405) are DRF's, and do no I/O.
        response = super().dispatch(request, *args, **kwargs)
        if isinstance(response, Response):
            response.render()  # here, or Django would render it in a worker thread
        return response

    @extend_schema(
        request=PredictRequest,
        responses={
            200: PredictResponse,
            400: _error(
                "The body is not valid JSON or does not fit the model's signature, or the "
                "version is neither a positive integer nor a valid alias name."
            ),
            401: _error("No API key, or an invalid or revoked one."),
            403: _error("`parameters.priority` asks for a class above the API key's."),
            404: _error("No such model (or version, or alias) in the key's tenant."),
            413: _error("The body is larger than SWITCHYARD_MAX_BODY_BYTES."),
            415: _error("The body is not JSON."),
            429: _error("The tenant's rate limit is spent: retry after `Retry-After` seconds."),
            503: _error("No serving agent can take the request now: retry after `Retry-After`."),
            504: _error("The serving agent did not answer within the deadline."),
        },
        # Required, though DRF's own checks never run here. The value is the security
        # requirement itself (drf-spectacular returns it as given; its annotation says str).
        auth=[{"apiKey": []}],  # type: ignore[list-item]
        examples=[
            OpenApiExample("named features", value={"instances": [{"amount": 12.5}]}),
            OpenApiExample(
                "scheduled",
                value={
                    "instances": [{"amount": 12.5}],
                    "parameters": {"priority": "batch", "timeout": 250_000},
                },
            ),
        ],
        description="Bearer API key required. Runs the model behind the `production` alias "
        "and its rollout plan; `/versions/{version}/predict` names a version number, or an "
        "alias name (`staging`), which goes through that alias's own rollout plan. JSON only. "
        "`parameters` schedules it as OIP's infer `parameters` do (priority class, timeout).",
    )
    async def post(self, request: Request, name: str, version: str | None = None) -> Response:
        # For the schema only (dispatch answers POST); a coroutine, as Django serves the view
        # as async only when all its handlers are.
        raise AssertionError("dispatch answers POST")

    async def predict(self, request: HttpRequest, name: str, version: str | None) -> HttpResponse:
        async def body() -> bytes:
            try:
                return request.body
            except RequestDataTooBig:
                raise ApiError(413, "request body is larger than the limit") from None

        state = get_state()
        reply = await answer(
            state, lambda h: request.headers.get(h), PredictURL(name, version), body
        )
        response = HttpResponse(reply.body, status=reply.status, content_type="application/json")
        for key, value in reply.headers:
            response[key] = value
        reply.finish()
        return response
