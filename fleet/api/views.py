"""The fleet over the API: deployments (a version on a pool, scaled by the autoscaler), their
scaling decisions, the pools, the live agents that serve the caller's tenant, where a version
is on them (its placements), and the artifact download agents make with their node token.
Thin views over ``fleet.deployments`` and ``fleet.assignments``.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models.fields.files import FieldFile
from django.http import FileResponse, HttpResponseRedirect
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.parsers import JSONBodyParser
from platform_site.tokens import bearer
from registry.access import model_for, version_for
from registry.models import ModelVersion
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of

from .. import rightsizing
from ..assignments import may_download
from ..deployments import (
    create_deployment,
    delete_deployment,
    deployment_for,
    deployments_of,
    pool_named,
    tenant_agents,
    update_deployment,
    version_of,
    version_placements,
)
from ..models import Pool
from ..nodes import authenticate_node
from .serializers import (
    AgentSerializer,
    DecisionFilter,
    DecisionSerializer,
    DeploymentInputSerializer,
    DeploymentSerializer,
    PlacementSerializer,
    PoolSerializer,
    RightsizingFilter,
    deployment_data,
)


class DeploymentListView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=DeploymentSerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        return Response(deployment_data(list(deployments_of(request.caller.tenant_id))))

    @extend_schema(
        request=DeploymentInputSerializer,
        responses={201: DeploymentSerializer},
        description="Deploy a version on a pool. 409 when it already has a deployment there.",
    )
    def post(self, request: CallerRequest) -> Response:
        body = DeploymentInputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        values = dict(body.validated_data)
        version = version_of(request.caller.tenant_id, values.pop("model"), values.pop("version"))
        pool = pool_named(values.pop("pool"))
        deployment = create_deployment(version, pool, values, actor_of(request))
        return Response(deployment_data([deployment])[0], status=status.HTTP_201_CREATED)


class DeploymentDetailView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]

    @extend_schema(responses=DeploymentSerializer)
    def get(self, request: CallerRequest, deployment_id: int) -> Response:
        deployment = deployment_for(request.caller.tenant_id, deployment_id)
        return Response(deployment_data([deployment])[0])

    @extend_schema(request=DeploymentInputSerializer, responses=DeploymentSerializer)
    def patch(self, request: CallerRequest, deployment_id: int) -> Response:
        deployment = deployment_for(request.caller.tenant_id, deployment_id)
        body = DeploymentInputSerializer(data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        updated = update_deployment(deployment, dict(body.validated_data), actor_of(request))
        return Response(deployment_data([updated])[0])

    @extend_schema(
        responses={204: None},
        description="409 while replicas run: set min_replicas to 0 and wait for scale to zero.",
    )
    def delete(self, request: CallerRequest, deployment_id: int) -> Response:
        deployment = deployment_for(request.caller.tenant_id, deployment_id)
        delete_deployment(deployment, actor_of(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class DecisionListView(APIView):
    """The autoscaler's decisions for one deployment, latest first, with what each saw."""

    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[DecisionFilter], responses=DecisionSerializer(many=True))
    def get(self, request: CallerRequest, deployment_id: int) -> Response:
        deployment = deployment_for(request.caller.tenant_id, deployment_id)
        where = DecisionFilter(data=request.query_params)
        where.is_valid(raise_exception=True)
        rows = deployment.decisions.order_by("-created_at", "-pk")[: where.validated_data["limit"]]
        return Response(DecisionSerializer(rows, many=True).data)


class PoolListView(APIView):
    """Pools are the platform's: every tenant sees them all and deploys onto them by name."""

    permission_classes = [TenantRolePermission]

    @extend_schema(responses=PoolSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response(PoolSerializer(Pool.objects.order_by("name"), many=True).data)


class AgentListView(APIView):
    """Live agents serving the caller's tenant (see ``tenant_agents``)."""

    permission_classes = [TenantRolePermission]

    @extend_schema(responses=AgentSerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        agents = tenant_agents(request.caller.tenant_id)
        return Response(AgentSerializer(agents, many=True).data)


class PlacementListView(APIView):
    """Where one of the caller's versions is on the live agents: each agent's load state, with
    the detail that explains it (a python package's environment building, or why it failed)."""

    permission_classes = [TenantRolePermission]

    @extend_schema(responses=PlacementSerializer(many=True))
    def get(self, request: CallerRequest, name: str, version: int) -> Response:
        found = version_for(model_for(request.caller.tenant_id, name), version)
        return Response(PlacementSerializer(version_placements(found), many=True).data)


class RightsizingView(APIView):
    """A model's measured utilisation, batch occupancy, queue time and cost, and the
    recommendations they justify (``fleet.rightsizing``). Any member reads it."""

    permission_classes = [TenantRolePermission]

    @extend_schema(parameters=[RightsizingFilter], responses=OpenApiTypes.OBJECT)
    def get(self, request: CallerRequest, name: str) -> Response:
        model = model_for(request.caller.tenant_id, name)
        where = RightsizingFilter(data=request.query_params)
        where.is_valid(raise_exception=True)
        window = timedelta(minutes=where.validated_data["minutes"])
        return Response(rightsizing.report(model, window))


def node_download(request: Request, version_id: int, what: str) -> ModelVersion | Response:
    """The version a node token may download a file of, or the answer refusing it."""
    node = authenticate_node(bearer(request.META.get("HTTP_AUTHORIZATION")))
    if node is None:
        return Response(
            {"error": "invalid node token"}, status=401, headers={"WWW-Authenticate": "Bearer"}
        )
    if not may_download(node, version_id):
        raise NotFound(f"no such {what} for this node")
    return ModelVersion.objects.get(pk=version_id)


class ArtifactView(APIView):
    """Agents download the artifacts of versions assigned to their node (node token)."""

    authentication_classes = []
    permission_classes = [AllowAny]

    @extend_schema(exclude=True)
    def get(
        self, request: Request, version_id: int
    ) -> Response | FileResponse | HttpResponseRedirect:
        version = node_download(request, version_id, "artifact")
        if isinstance(version, Response):
            return version
        return version_file(version.artifact, version.sha256, "application/octet-stream")


class TokenizerView(APIView):
    """Agents download the tokenizer attached to a version assigned to their node."""

    authentication_classes = []
    permission_classes = [AllowAny]

    @extend_schema(exclude=True)
    def get(
        self, request: Request, version_id: int
    ) -> Response | FileResponse | HttpResponseRedirect:
        version = node_download(request, version_id, "tokenizer")
        if isinstance(version, Response):
            return version
        if not version.tokenizer:
            raise NotFound("this version has no tokenizer")
        return version_file(version.tokenizer, version.tokenizer_sha256, "application/json")


def version_file(
    file: FieldFile, sha256: str, content_type: str
) -> FileResponse | HttpResponseRedirect:
    """One of a version's files for its agent, with its digest for the agent to check. From S3
    a fresh presigned URL instead: a bucket's bytes are never proxied (and an agent's client
    drops its Authorization header on a redirect to another origin)."""
    if settings.SWITCHYARD_STORAGE == "s3":
        return HttpResponseRedirect(file.url)
    response = FileResponse(file.open("rb"), content_type=content_type)
    response["X-Artifact-Sha256"] = sha256
    return response
