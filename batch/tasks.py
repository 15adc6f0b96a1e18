"""Celery tasks of batch jobs: thin, each takes an id and calls one domain function."""

from __future__ import annotations

from celery import shared_task

from platform_site.jobs import send

from . import jobs


@shared_task(name="batch.tasks.run_next_chunk", ignore_result=True)
def run_next_chunk(job_id: int) -> None:
    """One chunk of the job; the loop goes on by queueing itself while chunks remain."""
    if jobs.step(job_id):
        send(jobs.STEP_TASK, job_id)


@shared_task(name="batch.tasks.finish_job", ignore_result=True)
def finish_job(job_id: int) -> None:
    jobs.finish_job(job_id)


@shared_task(name="batch.tasks.reap_stalled_jobs", ignore_result=True)
def reap_stalled_jobs() -> int:
    """Beat: restart the loops of jobs whose worker died (their chunk's lease ran out)."""
    return jobs.reap_stalled()
