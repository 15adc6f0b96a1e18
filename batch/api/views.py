"""Batch jobs endpoints: thin views over batch.jobs, every lookup tenant-scoped."""

from __future__ import annotations

from django.http import FileResponse
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from platform_site.api import validated
from platform_site.parsers import JSONBodyParser
from tenants.authentication import CallerRequest, TenantRolePermission, actor_of
from tenants.models import Tenant

from .. import jobs
from .serializers import JobSerializer, JobSubmitSerializer

LIST_LIMIT = 200


class JobListView(APIView):
    permission_classes = [TenantRolePermission]
    parser_classes = [MultiPartParser, JSONBodyParser]

    @extend_schema(responses=JobSerializer(many=True))
    def get(self, request: CallerRequest) -> Response:
        found = list(jobs.jobs_of(request.caller.tenant_id)[:LIST_LIMIT])
        context = {"progress": jobs.progress_of(found)}
        return Response(JobSerializer(found, many=True, context=context).data)

    @extend_schema(request=JobSubmitSerializer, responses={201: JobSerializer})
    def post(self, request: CallerRequest) -> Response:
        if not hasattr(request.data, "get"):
            raise ValidationError({"body": "must be a JSON object or a multipart form"})
        body = validated(JobSubmitSerializer, request.data)
        job = jobs.submit_job(
            Tenant.objects.get(pk=request.caller.tenant_id),
            actor_of(request),
            body["model"],
            body["format"],
            upload=body.get("file"),
            input_name=body.get("input"),
            alias=body.get("alias"),
            version=body.get("version"),
            deadline=body.get("deadline"),
        )
        return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)


class JobDetailView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses=JobSerializer)
    def get(self, request: CallerRequest, job_id: int) -> Response:
        return Response(JobSerializer(jobs.job_for(request.caller.tenant_id, job_id)).data)


class JobActionView(APIView):
    """``pause``, ``resume`` or ``cancel`` (a write: engineers, approvers, deploy-scoped keys)."""

    permission_classes = [TenantRolePermission]
    parser_classes = [JSONBodyParser]
    action_name = ""

    @extend_schema(request=None, responses=JobSerializer)
    def post(self, request: CallerRequest, job_id: int) -> Response:
        job = jobs.job_for(request.caller.tenant_id, job_id)
        actor = actor_of(request)
        if self.action_name == "pause":
            job = jobs.pause_job(job, actor, reason="paused by " + actor.label)
        elif self.action_name == "resume":
            job = jobs.resume_job(job, actor)
        else:
            job = jobs.cancel_job(job, actor)
        return Response(JobSerializer(job).data)


class JobOutputView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses={(200, "application/x-ndjson"): bytes})
    def get(self, request: CallerRequest, job_id: int) -> FileResponse:
        job = jobs.job_for(request.caller.tenant_id, job_id)
        return FileResponse(
            jobs.output_file(job),
            as_attachment=True,
            filename=f"job-{job.pk}-output.jsonl",
            content_type="application/x-ndjson",
        )


class JobErrorsView(APIView):
    permission_classes = [TenantRolePermission]

    @extend_schema(responses={200: dict})
    def get(self, request: CallerRequest, job_id: int) -> Response:
        """The failed rows (row number and error), in row order, at most 1,000."""
        job = jobs.job_for(request.caller.tenant_id, job_id)
        return Response({"rows_failed": job.rows_failed, "errors": jobs.failed_rows(job)})
