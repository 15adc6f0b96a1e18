"""The DRF prediction API (plain JSON, named features) and artifact download for agents.

The prediction view is a sync DRF view, measured faster than an async (adrf) one under both
servers; it hands the work to the same async pipeline as OIP v2 on the server's event loop.
"""

from __future__ import annotations

from asgiref.sync import async_to_sync
from django.core.exceptions import RequestDataTooBig
from django.http import FileResponse
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.tokens import bearer
from registry.models import ModelVersion

from .. import nodes, pipeline
from ..pipeline import ApiError
from ..predict_codec import arrays_from_predict_body
from ..state import get_state


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


async def predict(authorization: str | None, name: str, version: int | None, read_body) -> dict:
    """The whole prediction on the server's event loop: one hop from the view's thread."""
    state = get_state()
    _, route = await pipeline.admit(
        state, authorization, name, None if version is None else str(version)
    )
    names, arrays, outputs = arrays_from_predict_body(read_body(), route)
    result = await pipeline.run_inference(state, route, names, arrays, outputs)
    return {
        "model": route.model_name,
        "version": route.version,
        "predictions": result[0][1].tolist(),
        "outputs": {n: a.tolist() for n, a in result},
    }


class PredictView(APIView):
    """``POST /api/v1/models/{name}/predict`` (and ``/versions/{v}/predict``)."""

    authentication_classes = []  # the pipeline authenticates from its in-process key cache
    permission_classes = [AllowAny]

    @extend_schema(
        request=PredictRequest,
        responses=PredictResponse,
        examples=[OpenApiExample("named features", value={"instances": [{"amount": 12.5}]})],
        description="Bearer API key required. Runs the model behind the `production` alias.",
    )
    def post(self, request, name: str, version: int | None = None):
        def read_body():
            # Parsing an in-memory body: no I/O, safe to run on the event loop.
            try:
                return request.data
            except RequestDataTooBig:
                raise ApiError(413, "request body is larger than the limit") from None

        auth = request.META.get("HTTP_AUTHORIZATION")
        try:
            return Response(async_to_sync(predict)(auth, name, version, read_body))
        except ApiError as exc:
            return Response({"error": exc.message}, status=exc.status, headers=dict(exc.headers))


class ArtifactView(APIView):
    """Agents download the artifacts of versions assigned to their node (node token)."""

    authentication_classes = []
    permission_classes = [AllowAny]

    @extend_schema(exclude=True)
    def get(self, request, version_id: int):
        node = nodes.authenticate_node(bearer(request.META.get("HTTP_AUTHORIZATION")))
        if node is None:
            return Response(
                {"error": "invalid node token"}, status=401, headers={"WWW-Authenticate": "Bearer"}
            )
        if not nodes.may_download(node, version_id):
            raise NotFound("no such artifact for this node")
        version = ModelVersion.objects.get(pk=version_id)
        response = FileResponse(
            version.artifact.open("rb"), content_type="application/octet-stream"
        )
        response["X-Artifact-Sha256"] = version.sha256
        return response
