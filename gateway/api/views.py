"""The DRF prediction API: plain JSON with named features, through the same async pipeline as
OIP v2, awaited on the server's event loop by an async DRF view (``AsyncPipelineView``)."""

from __future__ import annotations

import inspect
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from .. import pipeline, tracing
from ..dispatch import in_background
from ..metrics import Observed
from ..pipeline import ApiError
from ..predict_codec import arrays_from_predict_body
from ..state import GatewayState, get_state


class PredictRequest(serializers.Serializer):
    instances = serializers.ListField(
        required=False,
        help_text="Rows: objects of feature name → value, or lists of values in signature order.",
    )
    inputs = serializers.DictField(
        required=False, help_text="Columns: input name → nested list (batch first)."
    )
    outputs = serializers.ListField(child=serializers.CharField(), required=False)


class PredictResponse(serializers.Serializer):
    model = serializers.CharField()
    version = serializers.IntegerField()
    predictions = serializers.ListField()
    outputs = serializers.DictField()


class AsyncPipelineView(APIView):
    """A DRF view whose handlers are coroutines, run on the server's event loop.

    The data-path pipeline is async and authenticates from its own in-process cache, so DRF's
    ``initial()`` (no authenticators, AllowAny, no throttles) does no I/O and runs inline.
    Measured against a sync DRF view that hands the pipeline to the loop with async_to_sync:
    see bench/README.md.
    """

    authentication_classes = []  # the pipeline authenticates from its in-process key cache
    permission_classes = [AllowAny]

    # Async on purpose (Django awaits it, as its handlers are coroutines); the stubs know only
    # a sync dispatch.
    async def dispatch(  # type: ignore[override]
        self, request: HttpRequest, *args: Any, **kwargs: Any
    ) -> HttpResponse:
        self.args, self.kwargs = args, kwargs
        request = self.initialize_request(request, *args, **kwargs)
        self.request = request
        self.headers = self.default_response_headers
        try:
            self.initial(request, *args, **kwargs)
            assert request.method is not None  # every request a server hands over has one
            handler = getattr(self, request.method.lower(), self.http_method_not_allowed)
            response = handler(request, *args, **kwargs)
            if inspect.isawaitable(response):
                response = await response
        except Exception as exc:
            response = self.handle_exception(exc)
        response = self.finalize_response(request, response, *args, **kwargs)
        # Render here: Django would otherwise render a deferred response in a worker thread.
        response.render()
        return HttpResponse(response.content, status=response.status_code, headers=response.headers)


class PredictView(AsyncPipelineView):
    """``POST /api/v1/models/{name}/predict`` (and ``/versions/{v}/predict``)."""

    @extend_schema(
        request=PredictRequest,
        responses=PredictResponse,
        examples=[OpenApiExample("named features", value={"instances": [{"amount": 12.5}]})],
        description="Bearer API key required. Runs the model behind the `production` alias.",
    )
    async def post(self, request: Request, name: str, version: int | None = None) -> Response:
        state = get_state()
        try:
            trace = tracing.start_trace(
                request.headers.get("x-request-id"), request.headers.get("traceparent")
            )
        except tracing.BadRequestId as exc:
            return Response({"error": str(exc)}, status=400)
        token = tracing.current.set(trace)
        observed = Observed(trace)
        observed.predicting = True
        try:
            response = await self.predict(state, request, name, version, observed)
        finally:
            tracing.current.reset(token)  # sync callers (tests) would otherwise inherit it
        for header, value in trace.headers():
            response[header] = value
        state.observe(observed, response.status_code)
        return response

    async def predict(
        self,
        state: GatewayState,
        request: Request,
        name: str,
        version: int | None,
        observed: Observed,
    ) -> Response:
        try:
            identity, route = await pipeline.admit(
                state,
                request.META.get("HTTP_AUTHORIZATION"),
                name,
                None if version is None else str(version),
                observed,
            )
            try:
                data = request.data  # the body is already in memory: parsing does no I/O
            except RequestDataTooBig:
                raise ApiError(413, "request body is larger than the limit") from None
            names, arrays, outputs = arrays_from_predict_body(data, route)
            observed.mark("serialization")
            routed = await pipeline.route_request(
                state, identity, route, version is not None, request.headers.get, None
            )
            observed.arm = routed.arm
            observed.mark("routing")
            result = await pipeline.run_inference(
                state, routed.route, names, arrays, outputs, observed
            )
        except ApiError as exc:
            return Response({"error": exc.message}, status=exc.status, headers=dict(exc.headers))
        if routed.shadow_version_id is not None:
            in_background(pipeline.shadow_copy(state, identity, routed, names, arrays, result))
        body = {
            "model": routed.route.model_name,
            "version": routed.route.version,
            "predictions": result[0][1].tolist(),
            "outputs": {n: a.tolist() for n, a in result},
        }
        if routed.arm is not None:
            body["arm"] = routed.arm
        return Response(body)
