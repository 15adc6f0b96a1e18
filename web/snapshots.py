"""The numbers the web UI shows, built once for the first render and again every 2 s for the live
socket, so a page and its live updates always agree."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from fleet.deployments import deployments_of, replica_counts, tenant_agents
from fleet.models import Deployment, ScalingDecision
from monitoring.traffic import timeseries, versions_summary
from registry.access import models_of
from registry.models import Model
from rollouts.arms import plan_arm_metrics, plan_arms
from rollouts.models import (
    ACTIVE_STATES,
    OPEN_REQUEST_STATES,
    ApprovalRequest,
    PlanMode,
    PlanState,
    RequestKind,
    RolloutPlan,
)
from rollouts.shadow import shadow_summary


def active_plans(tenant_id: int) -> dict[tuple[int, str], RolloutPlan]:
    """{(model id, alias): plan} of the tenant's running or paused plans."""
    plans = (
        RolloutPlan.objects.filter(model__tenant_id=tenant_id, state__in=ACTIVE_STATES)
        .select_related("baseline", "candidate")
        .prefetch_related("arms")
    )
    return {(p.model_id, p.alias): p for p in plans}


def plan_split(plan: RolloutPlan, numbers: dict[int, int]) -> list[dict[str, Any]]:
    """The arms that answer clients, with version numbers and weights (shadow copies left out)."""
    return [
        {"arm": name, "version": numbers.get(vid), "weight": weight}
        for name, vid, weight in plan_arms(plan)
        if name != "shadow"
    ]


def model_row(model: Model, plans: dict[tuple[int, str], RolloutPlan]) -> dict[str, Any]:
    """One dashboard row: each alias's live split, and the model's traffic over the last minute."""
    numbers = {v.pk: v.version for v in model.versions.all()}
    aliases = []
    for alias in model.aliases.all():
        plan = plans.get((model.pk, alias.name))
        if plan is None:
            split = [{"arm": "all", "version": alias.version.version, "weight": 100.0}]
        else:
            split = plan_split(plan, numbers)
        aliases.append(
            {
                "name": alias.name,
                "version": alias.version.version,
                "plan": None
                if plan is None
                else {"id": plan.pk, "mode": plan.mode, "candidate": plan.candidate.version},
                "split": split,
            }
        )
    return {
        "name": model.name,
        "task": model.task,
        "versions": len(numbers),
        "aliases": aliases,
        "summary": versions_summary(list(numbers)),
    }


def agents_of(tenant_id: int) -> list[dict[str, Any]]:
    """Live agents that serve this tenant (``fleet.deployments.tenant_agents``: never another
    tenant's replicas or versions), as the dashboard lists them."""
    now = timezone.now()
    return [
        {
            "node": a["node"],
            "ready": [
                f"{v['model']} v{v['version']}" for v in a["serving"] if v["state"] == "ready"
            ],
            "queue_depth": a["queue_depth"],
            "in_flight": a["in_flight"],
            "p99_ms": a["p99_ms"],
            "last_heartbeat_at": (now - timedelta(seconds=a["last_heartbeat_age_s"])).isoformat(),
        }
        for a in tenant_agents(tenant_id, now)
    ]


def dashboard_snapshot(tenant_id: int) -> dict[str, Any]:
    plans = active_plans(tenant_id)
    models = models_of(tenant_id).prefetch_related("aliases__version", "versions")
    return {
        "models": [model_row(m, plans) for m in models],
        "agents": agents_of(tenant_id),
    }


def plan_timeline(plan: RolloutPlan, requests: list[ApprovalRequest]) -> dict[str, Any]:
    """The canary's steps as the rollout page's timeline draws them, Argo-style, as they
    happened (``RolloutPlan.weights_run``): each step done (the plan ran at it), current,
    killed (where a kill or rollback found it), skipped (jumped over), not reached (the plan
    ended before it), upcoming or waiting for approval (an open weight request for it), then
    the end state. The current step's bake ends at
    ``bake_ends_at``; the page counts down to it."""
    open_weights = {
        float(r.weight)
        for r in requests
        if r.kind == RequestKind.WEIGHT and r.state in OPEN_REQUEST_STATES and r.weight is not None
    }
    promotion_open = any(
        r.kind == RequestKind.PROMOTION and r.state in OPEN_REQUEST_STATES for r in requests
    )
    # What ran, as it happened (plans from before the record: every weight up to the current).
    history = [float(w["weight"]) for w in plan.weights_run]
    last = history[-1] if history else plan.weight
    ran = set(history) - {0.0} if history else {float(s) for s in plan.steps if s <= plan.weight}
    # A weight set by hand between two steps (or the first weight) is shown where it stands.
    weights = sorted({float(s) for s in plan.steps} | open_weights | ran)
    steps = []
    for weight in weights:
        if plan.is_active and weight == plan.weight:
            state = "current"
        elif plan.state == PlanState.ROLLED_BACK and weight == last and weight in ran:
            state = "killed"  # the step it was at when it was killed or rolled back
        elif weight in ran:
            state = "done"
        elif plan.state == PlanState.PROMOTED or (plan.is_active and weight < plan.weight):
            state = "skipped"  # jumped over: the plan never ran at it
        elif not plan.is_active:
            state = "not_reached"
        elif weight in open_weights:
            state = "approval"
        else:
            state = "upcoming"
        # Above max_weight the plan cannot move on its own: an approver must agree.
        steps.append({"weight": weight, "state": state, "gated": weight > plan.max_weight})
    if plan.state == PlanState.PROMOTED:
        end = "promoted"
    elif plan.state == PlanState.ROLLED_BACK:
        end = "rolled_back"
    else:
        end = "approval" if promotion_open else "upcoming"
    running = plan.state == PlanState.RUNNING
    bake_end = plan.step_started_at + timedelta(seconds=plan.bake_seconds)
    return {
        "steps": steps,
        "end": end,
        "bake_seconds": plan.bake_seconds,
        "bake_ends_at": bake_end.isoformat() if running else None,
        # The browser's clock may be off: the countdown runs from the server's now.
        "now": timezone.now().isoformat(),
    }


def plan_snapshot(plan: RolloutPlan) -> dict[str, Any]:
    """A plan's state, split, per-arm numbers for the current step and 15 minutes of series."""
    numbers = dict(plan.model.versions.values_list("pk", "version"))
    requests = list(plan.requests.all()[:10])
    return {
        "id": plan.pk,
        "state": plan.state,
        "active": plan.is_active,
        "weight": plan.weight,
        "status_note": plan.status_note,
        "ab_result": plan.ab_result,
        "step_started_at": plan.step_started_at.isoformat(),
        "split": plan_split(plan, numbers),
        "arms": plan_arm_metrics(plan, since=plan.step_started_at),
        "series": timeseries(
            {name: vid for name, vid, _ in plan_arms(plan)},
            plan_id=plan.pk if plan.mode == PlanMode.AB else None,
        ),
        "shadow": shadow_summary(plan) if plan.mode == PlanMode.SHADOW else None,
        "requests": [
            {
                "id": r.pk,
                "kind": r.kind,
                "state": r.state,
                "weight": r.weight,
                "arm_weights": r.arm_weights,
                "to_version": numbers.get(r.to_version_id),
                "requested_by": r.requested_label,
                "created_at": r.created_at.isoformat(),
            }
            for r in requests
        ],
        "timeline": plan_timeline(plan, requests) if plan.mode == PlanMode.CANARY else None,
    }


# Fleet ---------------------------------------------------------------------------------------

CHART_WINDOW = timedelta(minutes=30)  # at the 5 s control loop, 360 points per deployment
RECENT_DECISIONS = 20


def decision_row(decision: ScalingDecision) -> dict[str, Any]:
    """A decision with the inputs a person reads first: the load it answered (queued, running
    and held requests, as the autoscaler sums them), the p99 and the replicas it saw."""
    inputs = decision.inputs or {}
    load = sum(inputs.get(k) or 0 for k in ("queue_depth", "in_flight", "pending"))
    return {
        "at": decision.created_at,
        "current": decision.current,
        "desired": decision.desired,
        "accepted": decision.accepted,
        "dry_run": decision.dry_run,
        "reason": decision.reason,
        "error": decision.error,
        "load": load,
        "p99_ms": inputs.get("p99_ms"),
        "pending": inputs.get("pending", 0),
        "requests": inputs.get("requests", 0),
        "actual": inputs.get("actual"),
        "ready": inputs.get("ready"),
    }


def replica_series(deployment: Deployment, since: datetime) -> dict[str, list[Any]]:
    """Desired, accepted and live replicas per decision since ``since``, for the chart."""
    rows = (
        deployment.decisions.filter(created_at__gte=since)
        .order_by("created_at", "pk")
        .values_list("created_at", "desired", "accepted", "inputs__actual")
    )
    series: dict[str, list[Any]] = {"t": [], "desired": [], "accepted": [], "actual": []}
    for at, desired, accepted, actual in rows:
        series["t"].append(at.isoformat())
        series["desired"].append(desired)
        series["accepted"].append(accepted)
        series["actual"].append(actual)
    return series


def fleet_snapshot(tenant_id: int) -> dict[str, Any]:
    """The fleet page: each deployment's replicas (desired, live, ready), its recent decisions
    and their chart, and the agents serving the tenant."""
    now = timezone.now()
    deployments = list(deployments_of(tenant_id))
    counts = replica_counts(d.pk for d in deployments)
    rows, charts = [], {}
    for d in deployments:
        recent = [
            decision_row(x) for x in d.decisions.order_by("-created_at", "-pk")[:RECENT_DECISIONS]
        ]
        actual, ready = counts.get(d.pk, (0, 0))
        rows.append(
            {
                "deployment": d,
                "actual": actual,
                "ready": ready,
                "last": recent[0] if recent else None,
                "decisions": recent,
            }
        )
        charts[str(d.pk)] = replica_series(d, now - CHART_WINDOW)
    return {"deployments": rows, "charts": charts, "agents": tenant_agents(tenant_id, now)}
