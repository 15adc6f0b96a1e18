"""The batch jobs pages: the tenant's jobs with progress bars and a submit form (file upload),
and a job's page (a progress bar refreshed from ``/jobs/<id>/status/``, rate, ETA, deadline
verdict, pause/resume/cancel, the output download and the failed rows). Each action is one
call to the audited functions of ``batch.jobs``, writes for engineers and approvers only."""

from __future__ import annotations

from typing import Any, cast

from django.http import FileResponse, HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_POST

from batch import jobs
from batch.models import InputFormat, Job
from platform_site.errors import Conflict, Invalid, NotFound
from registry.access import models_of
from tenants.audit import user_actor
from tenants.members import can_write

from .pages import TenantRequest, page, tenant_view

ERRORS_SHOWN = 100


def _status(job: Job) -> dict[str, Any]:
    p = jobs.progress(job)
    return {
        "id": job.pk,
        "state": job.state,
        "pause_reason": job.pause_reason,
        "error": job.error,
        "rows_total": p.rows_total,
        "rows_done": p.rows_done,
        "rows_failed": p.rows_failed,
        "percent": p.percent,
        "rows_per_s": p.rows_per_s,
        "eta_s": p.eta_s,
        "on_time": p.on_time,
    }


def _jobs_page(request: TenantRequest, status: int = 200, error: str = "") -> HttpResponse:
    tenant_id = request.membership.tenant_id
    found = list(jobs.jobs_of(tenant_id)[:100])
    known = jobs.progress_of(found)
    listed = [(job, known[job.pk]) for job in found]
    context = {
        "jobs": listed,
        "models": models_of(tenant_id).order_by("name"),
        "formats": InputFormat.values,
        "error": error,
    }
    return page(request, "jobs.html", context, status=status)


@tenant_view
def jobs_list(request: TenantRequest) -> HttpResponse:
    if request.method == "POST":
        return _submit(request)
    return _jobs_page(request)


def _submit(request: TenantRequest) -> HttpResponse:
    membership = request.membership
    if not can_write(membership):
        return _jobs_page(request, 403, "viewers cannot submit jobs")
    form = request.POST
    try:
        version = form.get("version", "").strip()
        if version and not (version.isascii() and version.isdigit() and len(version) < 10):
            raise Invalid("version", "must be a version number")
        deadline = None
        if form.get("deadline", "").strip():
            deadline = parse_datetime(form["deadline"].strip())
            if deadline is None:
                raise Invalid("deadline", "not a date and time")
            if timezone.is_naive(deadline):
                deadline = timezone.make_aware(deadline)
        upload = request.FILES.get("file")
        if upload is None:
            raise Invalid("file", "choose a file to upload")
        job = jobs.submit_job(
            membership.tenant,
            user_actor(request.user, membership.role),
            form.get("model", "")[:100],
            form.get("format", ""),
            upload=upload,
            alias=form.get("alias", "").strip()[:64] or None,
            version=int(version) if version else None,
            deadline=deadline,
        )
    except Invalid as exc:
        return _jobs_page(request, 400, f"{exc.field}: {exc}")
    except NotFound as exc:
        return _jobs_page(request, 404, str(exc))
    return redirect("job", job_id=job.pk)


@tenant_view
def job_detail(request: TenantRequest, job_id: int) -> HttpResponse:
    job = jobs.job_for(request.membership.tenant_id, job_id)
    context = {"job": job, "status": _status(job), "failed": jobs.failed_rows(job, ERRORS_SHOWN)}
    return page(request, "job.html", context)


@tenant_view
def job_status(request: TenantRequest, job_id: int) -> JsonResponse:
    return JsonResponse(_status(jobs.job_for(request.membership.tenant_id, job_id)))


ACTIONS = ("pause", "resume", "cancel")


@tenant_view
@require_POST
def job_action(request: TenantRequest, job_id: int, action: str) -> HttpResponse:
    membership = request.membership
    job = jobs.job_for(membership.tenant_id, job_id)
    if action not in ACTIONS:
        raise NotFound(f"no action {action[:20]!r}")
    if not can_write(membership):
        return HttpResponse("viewers cannot change jobs", status=403)
    actor = user_actor(request.user, membership.role)
    try:
        if action == "pause":
            jobs.pause_job(job, actor, reason=f"paused by {actor.label}")
        elif action == "resume":
            jobs.resume_job(job, actor)
        else:
            jobs.cancel_job(job, actor)
    except Conflict as exc:
        return HttpResponse(str(exc), status=409)
    return redirect("job", job_id=job.pk)


@tenant_view
def job_output(request: TenantRequest, job_id: int) -> HttpResponse:
    job = jobs.job_for(request.membership.tenant_id, job_id)
    try:
        fh = jobs.output_file(job)
    except Conflict as exc:
        return HttpResponse(str(exc), status=409)
    # A FileResponse streams the file; the page decorator's type names any response.
    response = FileResponse(
        fh,
        as_attachment=True,
        filename=f"job-{job.pk}-output.jsonl",
        content_type="application/x-ndjson",
    )
    return cast(HttpResponse, response)
