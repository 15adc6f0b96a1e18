"""Applying an autoscaler decision: ask the cluster backend, record only what it accepted.

The database never claims a scale the cluster refused: ``Deployment.desired_replicas`` moves
only after the backend's ``ScaleResult.accepted``, and every attempt (accepted, refused or dry
run) is stored as a ``ScalingDecision`` with its inputs and reason.
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from .autoscale import Decision, ScalingPolicy
from .cluster import ClusterBackend, ClusterError, NotFound
from .models import Deployment, ScalingDecision


def policy_of(deployment: Deployment) -> ScalingPolicy:
    return ScalingPolicy(
        min_replicas=deployment.min_replicas,
        max_replicas=deployment.max_replicas,
        target_load_per_replica=deployment.target_load_per_replica,
        slo_p99_ms=deployment.slo_p99_ms,
        scale_down_window_s=deployment.scale_down_window_s,
        idle_to_zero_s=deployment.idle_to_zero_s,
    )


def apply_decision(
    deployment: Deployment,
    decision: Decision,
    backend: ClusterBackend,
    dry_run: bool = False,
    at: datetime | None = None,
) -> ScalingDecision:
    """Scale through the backend (outside any transaction: it may retry for seconds), then
    record the outcome; ``desired_replicas`` follows only an accepted scale."""
    current = deployment.desired_replicas
    accepted, error = None, ""
    try:
        result = backend.scale(deployment.cluster_name, decision.desired, dry_run=dry_run)
        accepted = result.accepted
    except NotFound as exc:
        # The agent template is gone from the cluster (deleted by hand, a wiped state folder):
        # forget that it was applied, so the next pass applies it again.
        error = str(exc)[:300]
        Deployment.objects.filter(pk=deployment.pk).update(applied_template="")
        deployment.applied_template = ""
    except ClusterError as exc:
        error = str(exc)[:300]
    with transaction.atomic():
        if accepted is not None:
            Deployment.objects.filter(pk=deployment.pk).update(desired_replicas=accepted)
            deployment.desired_replicas = accepted
        return ScalingDecision.objects.create(
            deployment=deployment,
            current=current,
            desired=decision.desired,
            accepted=accepted,
            dry_run=dry_run,
            reason=decision.reason[:300],
            inputs=decision.inputs,
            error=error,
            created_at=at or timezone.now(),
        )
