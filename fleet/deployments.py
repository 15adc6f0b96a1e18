"""Deployments as the API, the web UI and the admin change them: tenant-scoped lookups, audited
create/update/delete, and the live agents that serve a tenant.

The autoscaler owns ``desired_replicas`` and the activity fields (``fleet.autoscaler``); callers
set only the settings below, and a deployment's version and pool never change (its cluster
name carries them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from platform_site.errors import Conflict, Invalid, NotFound
from registry.models import ModelVersion
from tenants.audit import Actor, audit

from .autoscaler import backend_for
from .cluster import ClusterError
from .models import AgentSession, Deployment, Pool
from .nodes import live_sessions

log = logging.getLogger(__name__)

# What a caller may set on a deployment; the rest is the autoscaler's (desired_replicas, the
# activity times, the applied template) or its identity (version and pool: the cluster name
# carries them).
SETTINGS = (
    "min_replicas",
    "max_replicas",
    "target_load_per_replica",
    "slo_p99_ms",
    "scale_down_window_s",
    "idle_to_zero_s",
    "cpu",
    "memory",
    "gpus",
    "mig_profile",
    "isolation",
)
IDENTITY = ("model", "version", "pool")
READ_ONLY = {
    "desired_replicas": "read-only: only what the cluster accepted, set by the autoscaler",
    "actual_replicas": "read-only: counted from the live replicas",
    "ready_replicas": "read-only: counted from the live replicas",
}


# Lookups -------------------------------------------------------------------------------------


def deployments_of(tenant_id: int) -> QuerySet[Deployment]:
    """Every deployment lookup goes through here, so another tenant's is never found."""
    return (
        Deployment.objects.filter(tenant_id=tenant_id)
        .select_related("version__model", "pool")
        .order_by("version__model__name", "version__version", "pool__name")
    )


def deployment_for(tenant_id: int, deployment_id: int) -> Deployment:
    found = deployments_of(tenant_id).filter(pk=deployment_id).first()
    if found is None:
        raise NotFound(f"no deployment {deployment_id}")
    return found


def version_of(tenant_id: int, model: str, number: int) -> ModelVersion:
    """A version of one of the tenant's models, or a 400 naming the field that is wrong."""
    found = ModelVersion.objects.select_related("model").filter(
        model__tenant_id=tenant_id, model__name=model
    )
    if not found.exists():
        raise ValidationError({"model": f"this tenant has no model named {model!r}"})
    version = found.filter(version=number).first()
    if version is None:
        raise ValidationError({"version": f"model {model!r} has no version {number}"})
    return version


def pool_named(name: str) -> Pool:
    pool = Pool.objects.filter(name=name).first()
    if pool is None:
        raise ValidationError({"pool": f"there is no pool named {name!r}"})
    return pool


def replica_counts(deployment_ids: Iterable[int]) -> dict[int, tuple[int, int]]:
    """{deployment id: (live replicas, replicas with its version ready)} in one query."""
    counts: dict[int, tuple[int, int]] = {}
    rows = live_sessions().filter(deployment_id__in=list(deployment_ids))
    for pk, vid, ready in rows.values_list(
        "deployment_id", "deployment__version_id", "ready_versions"
    ):
        actual, ready_count = counts.get(pk, (0, 0))
        counts[pk] = (actual + 1, ready_count + (vid in ready))
    return counts


# Changes -------------------------------------------------------------------------------------


def settings_of(deployment: Deployment) -> dict[str, Any]:
    """A deployment as its audit events record it."""
    return {
        "model": deployment.version.model.name,
        "version": deployment.version.version,
        "pool": deployment.pool.name,
        **{name: getattr(deployment, name) for name in SETTINGS},
    }


def create_deployment(
    version: ModelVersion, pool: Pool, values: dict[str, Any], actor: Actor
) -> Deployment:
    """Deploy a version on a pool; the control loop starts its replicas (from ``min_replicas``,
    or at the first request when that is 0)."""
    if not version.format_entry.runs_on_agent:
        # A graph runs on the gateway: its nodes' versions are what agents load.
        raise Invalid(
            "version", "a graph runs on the gateway, not on agents: deploy the versions it names"
        )
    deployment = Deployment(tenant_id=version.model.tenant_id, version=version, pool=pool, **values)
    deployment.full_clean(validate_constraints=False)  # min <= max and each field's bounds
    taken = Conflict(
        f"version {version.version} of {version.model.name!r} already has a deployment on pool "
        f"{pool.name!r}"
    )
    if Deployment.objects.filter(version=version, pool=pool).exists():
        raise taken
    try:
        with transaction.atomic():
            deployment.save()
            audit(
                deployment.tenant_id,
                actor,
                "deployment.create",
                str(deployment),
                after=settings_of(deployment),
            )
    except IntegrityError:  # two creates raced past the check: the constraint picked one
        raise taken from None
    return deployment


def update_deployment(deployment: Deployment, changes: dict[str, Any], actor: Actor) -> Deployment:
    """Change bounds, targets, windows, resources or isolation; the next control-loop pass
    scales within the new bounds and re-applies the agent template if resources changed."""
    with transaction.atomic():
        # Row lock: two changes racing end in one consistent row. Only the changed fields are
        # saved: the control loop writes desired_replicas and the activity times without this
        # lock, and a full save would put back the values read here.
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        locked.version, locked.pool = deployment.version, deployment.pool
        before = settings_of(locked)
        for name, value in changes.items():
            setattr(locked, name, value)
        locked.full_clean(validate_constraints=False)
        locked.save(update_fields=[*changes, "updated_at"])
        after = settings_of(locked)
        if after != before:
            audit(locked.tenant_id, actor, "deployment.update", str(locked), before, after)
    return locked


def delete_deployment(deployment: Deployment, actor: Actor) -> None:
    """Remove a deployment that runs no replica, and its (scaled to zero) agent template.

    The control loop only scales deployments it has rows for: deleting one with replicas up
    would leave them running, unscaled, for good. So the caller lowers ``min_replicas`` to 0
    and lets the autoscaler scale it to zero first.
    """
    with transaction.atomic():
        # Row lock against a concurrent change or delete. The control loop scales without it;
        # a scale it began after this check is undone by deleting the agent template from
        # the cluster after the commit (below).
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        locked.version, locked.pool = deployment.version, deployment.pool
        running = max(
            locked.desired_replicas, live_sessions().filter(deployment_id=locked.pk).count()
        )
        if running:
            raise Conflict(
                f"{locked.cluster_name} still runs {running} replica(s): set min_replicas to 0 "
                f"and delete it once the autoscaler has scaled it to zero (after "
                f"{locked.idle_to_zero_s} s without requests)"
            )
        before, name, pool = settings_of(locked), locked.cluster_name, locked.pool
        applied = bool(locked.applied_template)
        audit(locked.tenant_id, actor, "deployment.delete", str(locked), before=before)
        locked.delete()
        if applied:
            # Slow I/O, after the commit: the row is gone, so no pass of the loop re-applies it.
            transaction.on_commit(lambda: remove_from_cluster(pool, name))


def remove_from_cluster(pool: Pool, name: str) -> None:
    """Delete a deployment's agent template from its cluster; a failure only leaves an agent
    Deployment at zero replicas behind, so it is logged rather than raised."""
    try:
        backend_for(pool).delete(name)
    except ClusterError as exc:
        log.warning("could not delete %s from pool %s: %s", name, pool.name, exc)


# Agents --------------------------------------------------------------------------------------


def heartbeat_health(last_heartbeat_at: datetime, now: datetime) -> tuple[str, float]:
    """("healthy" | "stale", seconds since the last heartbeat): healthy while at most two
    heartbeats in a row went missing."""
    age = max((now - last_heartbeat_at).total_seconds(), 0.0)
    healthy = age <= settings.SWITCHYARD_AGENT_HEARTBEAT_S * 3
    return ("healthy" if healthy else "stale"), round(age, 1)


def _serving(tenant_id: int) -> Q:
    """The sessions that may serve this tenant: replicas of its deployments, and nodes run by
    hand that are its own or serve every tenant."""
    in_scope = Q(node__tenant_id=tenant_id) | Q(node__tenant__isnull=True)
    ours = Q(deployment__tenant_id=tenant_id) | Q(deployment_name="")
    return in_scope & ours


def tenant_agents(tenant_id: int, now: datetime | None = None) -> list[dict[str, Any]]:
    """The live agents that serve this tenant: replicas of its deployments, and nodes run by
    hand that are its own or serve every tenant.

    A node shared with other tenants shows only this tenant's versions, and its queue and
    in-flight count only their requests; its memory, GPU use and p99 are the whole agent's
    (a capacity figure that names nobody's model).
    """
    now = now or timezone.now()
    sessions = list(
        live_sessions()
        .filter(_serving(tenant_id))
        .select_related("node", "deployment__version")
        .order_by("node__name", "pk")
    )
    seen = {int(v) for s in sessions for v in [*s.ready_versions, *s.version_states]}
    labels = {
        pk: (model, number)
        for pk, model, number in ModelVersion.objects.filter(
            pk__in=seen, model__tenant_id=tenant_id
        ).values_list("pk", "model__name", "version")
    }
    return [_agent_row(s, labels, now) for s in sessions]


def _agent_row(
    session: AgentSession, labels: dict[int, tuple[str, int]], now: datetime
) -> dict[str, Any]:
    stats = session.stats or {}
    shared = session.deployment_id is None and session.node.tenant_id is None
    held = {int(v) for v in [*session.ready_versions, *session.version_states]}
    serving = []
    for vid in sorted(held & labels.keys()):  # never another tenant's version
        state = (session.version_states.get(str(vid)) or {}).get("state")
        state = state or ("ready" if vid in session.ready_versions else "assigned")
        if state != "unloaded":
            model, number = labels[vid]
            serving.append({"model": model, "version": number, "state": state})
    queue, in_flight = stats.get("queue_depth", 0), stats.get("in_flight", 0)
    if shared:  # the agent's totals include other tenants' requests
        loads = [v for v in stats.get("versions", []) if v.get("version_id") in labels]
        queue = sum(v.get("queue_depth", 0) for v in loads)
        in_flight = sum(v.get("in_flight", 0) for v in loads)
    health, age = heartbeat_health(session.last_heartbeat_at, now)
    return {
        "node": session.node.name,
        "kind": "replica" if session.deployment_id else "node",
        "shared": shared,
        "deployment": session.deployment.cluster_name if session.deployment is not None else None,
        "health": health,
        "last_heartbeat_age_s": age,
        "serving": serving,
        "queue_depth": queue,
        "in_flight": in_flight,
        "p99_ms": stats.get("p99_ms"),
        "memory_used_bytes": stats.get("memory_used_bytes", 0),
        "memory_budget_bytes": stats.get("memory_budget_bytes") or session.memory_budget_bytes,
        "gpus": stats.get("gpus", []),
    }


def version_placements(version: ModelVersion, now: datetime | None = None) -> list[dict[str, Any]]:
    """Where a version (already looked up through its tenant) is on the live agents: per
    agent, its load state as the agent last reported it, with the detail that explains it
    ("building environment: ..." while a python package's environment builds, the installer's
    or the loader's error when it failed), the provider that runs it and its measured memory.
    Only the agents that may serve its tenant are asked, and only about this version."""
    now = now or timezone.now()
    key = str(version.pk)
    sessions = (
        live_sessions()
        .filter(_serving(version.model.tenant_id))
        .select_related("node", "deployment")
        .order_by("node__name", "pk")
    )
    placements = []
    for session in sessions:
        reported = (session.version_states or {}).get(key)
        ready = version.pk in (session.ready_versions or [])
        if not isinstance(reported, dict) and not ready:
            continue
        reported = reported if isinstance(reported, dict) else {}
        state = reported.get("state") or "ready"
        if state == "unloaded":
            continue
        health, age = heartbeat_health(session.last_heartbeat_at, now)
        placements.append(
            {
                "node": session.node.name,
                "kind": "replica" if session.deployment_id else "node",
                "deployment": (
                    session.deployment.cluster_name if session.deployment is not None else None
                ),
                "state": str(state),
                "detail": str(reported.get("detail") or ""),
                "provider": str(reported.get("provider") or ""),
                "memory_bytes": int(reported.get("memory_bytes") or 0),
                "health": health,
                "last_heartbeat_age_s": age,
            }
        )
    return placements
