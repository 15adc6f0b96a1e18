"""The autoscaler's control loop (``autoscale_all``, a Celery beat task), and the cluster side
of a deployment: its backend, its agent template and the pool's node token.

Per deployment: one ``Signal`` from its replicas' heartbeats and the gateway's cold-start wakes
(``fleet.coldstart``), one decision over the signals of the stabilisation window
(``fleet.autoscale.decide``), the tenant's replica quota, then the backend; every decision is
stored with its inputs. Replicas are agents a backend started for one deployment: they name it
in their hello and serve its version only (``fleet.assignments``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, fields
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from tenants.models import Quota

from .autoscale import Decision, Signal, decide
from .cluster import AgentTemplate, ClusterBackend, ClusterError
from .models import ClusterKind, Deployment, Isolation, Node, Pool, ScalingDecision
from .nodes import create_node, live_sessions, rotate_node_token
from .scaling import apply_decision, policy_of

log = logging.getLogger(__name__)

TOKEN_SECRET = "switchyard-agent-token"  # the Secret agents' pods mount (deploy/README.md)
TENANT_LABEL = "switchyard.io/tenant"
DEDICATED_TAINT = "switchyard.io/dedicated"


# The control loop ----------------------------------------------------------------------------


def ensure_pool_token(pool: Pool) -> Path:
    """The local backend's agents authenticate as the node ``pool-<name>``; only the hash is
    in the database, so the raw token lives in a file only this user can read."""
    # A dot folder: the local backend takes the other folders there for deployments.
    path = settings.SWITCHYARD_LOCAL_AGENTS_DIR / ".tokens" / f"{pool.name}.token"
    node = Node.objects.filter(name=f"pool-{pool.name}").first()
    if node is not None and path.exists():
        return path
    raw = rotate_node_token(node) if node else create_node(f"pool-{pool.name}")[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(raw)
    return path


def backend_for(pool: Pool) -> ClusterBackend:
    if pool.backend == ClusterKind.LOCAL:
        from .cluster.local import LocalBackend

        return LocalBackend(
            settings.SWITCHYARD_LOCAL_AGENTS_DIR,
            settings.SWITCHYARD_PLATFORM_URL,
            ensure_pool_token(pool),
        )
    from .cluster.kubernetes import KubernetesBackend

    try:
        return KubernetesBackend.from_environment(pool.namespace)
    except Exception as exc:  # no in-cluster config and no kubeconfig
        raise ClusterError(f"cannot reach Kubernetes: {exc}") from exc


def template_for(deployment: Deployment) -> AgentTemplate:
    pool, tenant = deployment.pool, deployment.tenant
    selector, tolerations = dict(pool.node_selector), list(pool.tolerations)
    if deployment.isolation == Isolation.DEDICATED:
        # Dedicated nodes carry the tenant's label and taint; nobody else's pods land there.
        selector[TENANT_LABEL] = tenant.slug
        tolerations.append(
            {
                "key": DEDICATED_TAINT,
                "operator": "Equal",
                "value": tenant.slug,
                "effect": "NoSchedule",
            }  # fmt: skip
        )
    return AgentTemplate(
        name=deployment.cluster_name,
        namespace=pool.namespace,
        image=pool.image or settings.SWITCHYARD_AGENT_IMAGE,
        platform_url=settings.SWITCHYARD_PLATFORM_URL,
        token_secret=TOKEN_SECRET,
        replicas=deployment.desired_replicas,
        cpu=deployment.cpu,
        memory=deployment.memory,
        gpus=deployment.gpus,
        mig_profile=deployment.mig_profile or None,
        node_selector=selector,
        tolerations=tolerations,
        labels={TENANT_LABEL: tenant.slug, "switchyard.io/pool": pool.name},
    )


def template_hash(template: AgentTemplate) -> str:
    spec = asdict(template) | {"replicas": None}  # scaling is not a template change
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def gather_signal(
    deployment: Deployment, now: datetime, last: ScalingDecision | None
) -> tuple[Signal, dict[str, Any]]:
    """What the deployment's replicas report now, and what the decision should store."""
    replicas = list(live_sessions().filter(deployment=deployment).select_related("node"))
    vid = deployment.version_id
    previous = (last.inputs.get("totals") or {}) if last else {}
    totals, served, queue, in_flight, p99, held = {}, 0, 0.0, 0.0, 0.0, []
    for session in replicas:
        stats = session.stats or {}
        total = int(stats.get("requests_total", 0))
        totals[str(session.pk)] = total
        # A replica new since the last decision counts all it served; a restarted one, too.
        before = previous.get(str(session.pk), 0)
        recent = total - before if total >= before else total
        served += recent
        waiting, running = stats.get("queue_depth", 0), stats.get("in_flight", 0)
        queue += waiting
        # The heartbeat's instant can miss the work of a fast model: the load averaged over the
        # heartbeat interval counts it (whatever is not queued now counts as in flight).
        in_flight += max(running, stats.get("load_avg", 0.0) - waiting)
        if recent:  # a replica's p99 window is stale once it stops serving
            p99 = max(p99, float(stats.get("p99_ms", 0.0)))
        held.append(
            {
                "session": session.pk,
                "agent": session.node.name,
                "ready": vid in session.ready_versions,
                "holds": sorted(session.ready_versions),
                "queue_depth": stats.get("queue_depth", 0),
                "in_flight": stats.get("in_flight", 0),
            }
        )
    woken_at = deployment.woken_at
    woken = woken_at is not None and (last is None or woken_at > last.created_at)
    signal = Signal(
        at=now.timestamp(),
        replicas=deployment.desired_replicas,
        queue_depth=queue,
        in_flight=in_flight,
        p99_ms=round(p99, 3),
        requests=served,
        pending=int(woken),
    )
    extra = {
        "actual": len(replicas),
        "ready": sum(r["ready"] for r in held),
        "replicas_detail": held,
        "totals": totals,
    }
    return signal, extra


def history_of(deployment: Deployment, now: datetime) -> list[Signal]:
    """The signals of earlier decisions inside the scale-down window, oldest first."""
    since = now - timedelta(seconds=deployment.scale_down_window_s)
    names = {f.name for f in fields(Signal)}
    rows = deployment.decisions.filter(created_at__gte=since).order_by("created_at", "pk")
    history = []
    for inputs in rows.values_list("inputs", flat=True):
        values = {k: inputs[k] for k in names if k in inputs}
        if len(values) == len(names):
            history.append(Signal(**values))
    return history


def quota_cap(deployment: Deployment, desired: int) -> tuple[int, str]:
    """Hold a shared-pool deployment within its tenant's replica quota."""
    if deployment.isolation != Isolation.SHARED:
        return desired, ""
    limit = (
        Quota.objects.filter(tenant_id=deployment.tenant_id)
        .values_list("max_replicas", flat=True)
        .first()
    )
    if limit is None:
        return desired, ""
    others = (
        Deployment.objects.filter(tenant_id=deployment.tenant_id, isolation=Isolation.SHARED)
        .exclude(pk=deployment.pk)
        .aggregate(n=Sum("desired_replicas"))["n"]
        or 0
    )
    room = max(limit - others, 0)
    if desired <= room:
        return desired, ""
    return room, f"; capped at {room} by the tenant's quota of {limit} replicas"


def autoscale_deployment(
    deployment: Deployment, backend: ClusterBackend | None, now: datetime | None = None
) -> ScalingDecision:
    """One control-loop step for one deployment; returns the stored decision."""
    now = now or timezone.now()
    last = deployment.decisions.order_by("-created_at", "-pk").first()
    signal, extra = gather_signal(deployment, now, last)
    if signal.requests or signal.pending:
        deployment.last_active_at = now
        Deployment.objects.filter(pk=deployment.pk).update(last_active_at=now)
    decision = decide(
        policy_of(deployment),
        [*history_of(deployment, now), signal],
        deployment.last_active_at.timestamp(),
    )
    desired, capped = quota_cap(deployment, decision.desired)
    decision = Decision(desired, decision.reason + capped, decision.inputs | extra)
    if backend is None:
        return _record(deployment, decision, None, "no cluster backend for this pool", now)
    try:
        _apply_template(deployment, backend)
    except ClusterError as exc:
        return _record(deployment, decision, None, f"applying the agent template: {exc}", now)
    if desired == deployment.desired_replicas:
        return _record(deployment, decision, desired, "", now)
    return apply_decision(deployment, decision, backend, at=now)


def _apply_template(deployment: Deployment, backend: ClusterBackend) -> None:
    template = template_for(deployment)
    digest = template_hash(template)
    if digest == deployment.applied_template:
        return
    backend.apply(template)
    Deployment.objects.filter(pk=deployment.pk).update(applied_template=digest)
    deployment.applied_template = digest


def _record(
    deployment: Deployment, decision: Decision, accepted: int | None, error: str, at: datetime
) -> ScalingDecision:
    return ScalingDecision.objects.create(
        created_at=at,
        deployment=deployment,
        current=deployment.desired_replicas,
        desired=decision.desired,
        accepted=accepted,
        reason=decision.reason[:300],
        inputs=decision.inputs,
        error=error[:300],
    )


def autoscale_all(deployment_id: int | None = None) -> dict[int, str]:
    """One pass of the control loop over every deployment (or one); returns id -> reason."""
    now = timezone.now()
    deployments = Deployment.objects.select_related("pool", "tenant", "version")
    if deployment_id is not None:
        deployments = deployments.filter(pk=deployment_id)
    backends: dict[int, ClusterBackend | None] = {}
    done = {}
    for deployment in deployments:
        pool = deployment.pool
        if pool.pk not in backends:
            try:
                backends[pool.pk] = backend_for(pool)
            except ClusterError as exc:
                log.error("pool %s: %s", pool.name, exc)
                backends[pool.pk] = None
        decision = autoscale_deployment(deployment, backends[pool.pk], now)
        done[deployment.pk] = decision.reason
        if decision.accepted != decision.current:
            log.info("deployment %s: %s", deployment.pk, decision)
    for backend in backends.values():
        reconcile = getattr(backend, "reconcile_all", None)
        if reconcile is not None:
            reconcile()  # the local backend restarts replicas whose process died
    cutoff = now - timedelta(hours=settings.SWITCHYARD_SCALING_HISTORY_HOURS)
    ScalingDecision.objects.filter(created_at__lt=cutoff).delete()
    return done
