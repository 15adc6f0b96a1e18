"""The numbers the web UI shows, built once for the first render and again every 2 s for the live
socket, so a page and its live updates always agree."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from registry.models import Model, ModelVersion
from registry.services import models_of
from rollouts.metrics import plan_arm_metrics, plan_arms, timeseries, versions_summary
from rollouts.models import ACTIVE_STATES, PlanMode, RolloutPlan
from rollouts.shadow import shadow_summary

from .models import AgentSession


def active_plans(tenant_id: int) -> dict[tuple[int, str], RolloutPlan]:
    """{(model id, alias): plan} of the tenant's running or paused plans."""
    plans = (
        RolloutPlan.objects.filter(model__tenant_id=tenant_id, state__in=ACTIVE_STATES)
        .select_related("baseline", "candidate")
        .prefetch_related("arms")
    )
    return {(p.model_id, p.alias): p for p in plans}


def plan_split(plan: RolloutPlan, numbers: dict[int, int]) -> list[dict]:
    """The arms that answer clients, with version numbers and weights (shadow copies left out)."""
    return [
        {"arm": name, "version": numbers.get(vid), "weight": weight}
        for name, vid, weight in plan_arms(plan)
        if name != "shadow"
    ]


def model_row(model: Model, plans: dict[tuple[int, str], RolloutPlan]) -> dict:
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


def agents_of(tenant_id: int) -> list[dict]:
    """Live agents that may serve this tenant (its own nodes and shared ones), listing only this
    tenant's versions among those they have ready."""
    horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD["AGENT_STALE_S"])
    sessions = AgentSession.objects.select_related("node").filter(
        Q(node__tenant_id=tenant_id) | Q(node__tenant__isnull=True),
        disconnected_at__isnull=True,
        last_heartbeat_at__gte=horizon,
    )
    labels = {
        pk: f"{name} v{number}"
        for pk, name, number in ModelVersion.objects.filter(model__tenant_id=tenant_id).values_list(
            "pk", "model__name", "version"
        )
    }
    return [
        {
            "node": s.node.name,
            "ready": [labels[v] for v in s.ready_versions if v in labels],
            "queue_depth": s.stats.get("queue_depth", 0),
            "in_flight": s.stats.get("in_flight", 0),
            "p99_ms": s.stats.get("p99_ms"),
            "last_heartbeat_at": s.last_heartbeat_at.isoformat(),
        }
        for s in sessions
    ]


def dashboard_snapshot(tenant_id: int) -> dict:
    plans = active_plans(tenant_id)
    models = models_of(tenant_id).prefetch_related("aliases__version", "versions")
    return {
        "models": [model_row(m, plans) for m in models],
        "agents": agents_of(tenant_id),
    }


def plan_snapshot(plan: RolloutPlan) -> dict:
    """A plan's state, split, per-arm numbers for the current step and 15 minutes of series."""
    numbers = dict(plan.model.versions.values_list("pk", "version"))
    return {
        "id": plan.pk,
        "state": plan.state,
        "active": plan.is_active,
        "weight": plan.weight,
        "status_note": plan.status_note,
        "step_started_at": plan.step_started_at.isoformat(),
        "split": plan_split(plan, numbers),
        "arms": plan_arm_metrics(plan, since=plan.step_started_at),
        "series": timeseries({name: vid for name, vid, _ in plan_arms(plan)}),
        "shadow": shadow_summary(plan) if plan.mode == PlanMode.SHADOW else None,
        "requests": [
            {
                "id": r.pk,
                "kind": r.kind,
                "state": r.state,
                "weight": r.weight,
                "to_version": numbers.get(r.to_version_id),
                "requested_by": r.requested_label,
                "created_at": r.created_at.isoformat(),
            }
            for r in plan.requests.all()[:10]
        ],
    }
