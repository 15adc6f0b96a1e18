"""Admin for nodes (a new token is shown once, in the response page itself), their agents'
sessions, pools, deployments (changed through the same audited functions as the API) and the
autoscaler's decisions."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict

from django.conf import settings
from django.contrib import admin
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone

from tenants.admin_audit import AuditedAdmin
from tenants.audit import user_actor
from tenants.shown_once import remember, shown_once_page

from .deployments import (
    SETTINGS,
    create_deployment,
    delete_deployment,
    heartbeat_health,
    update_deployment,
)
from .gateways import LIVE_S
from .models import AgentSession, Deployment, GatewayProcess, Node, Pool, ScalingDecision
from .nodes import create_node, rotate_node_token

if TYPE_CHECKING:
    from django_stubs_ext import WithAnnotations

INLINE_DECISIONS_MIN = 10
MIB = 1 << 20


class DeploymentCount(TypedDict):
    deployment_count: int  # PoolAdmin's queryset counts each pool's deployments


class LiveReplicas(TypedDict):
    live: int  # DeploymentAdmin's queryset counts each deployment's live agents


@admin.register(Node)
class NodeAdmin(AuditedAdmin[Node]):
    list_display = ["name", "tenant", "enabled", "last_seen_at"]
    readonly_fields = ["token_prefix", "facts", "last_seen_at", "created_at"]
    actions = ["rotate_token"]

    def save_model(self, request: HttpRequest, obj: Node, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        node, raw = create_node(obj.name, obj.tenant, user_actor(request.user))
        obj.pk = node.pk
        remember(request, f"Token of node {node}", raw)
        remember(
            request,
            "Start its agent with (or keep the token in a 0600 file and pass --token-file):",
            f"python -m serving_agent --platform {request.scheme}://{request.get_host()} "
            f"--token {raw}",
        )

    def response_add(
        self, request: HttpRequest, obj: Node, post_url_continue: str | None = None
    ) -> HttpResponse:
        # The token is shown in this response, never through the messages cookie of a redirect.
        page = shown_once_page(request, "Node created", "the token", self._changelist())
        return page or super().response_add(request, obj, post_url_continue)

    @admin.action(description="Rotate the token of the selected node")
    def rotate_token(self, request: HttpRequest, queryset: QuerySet[Node]) -> HttpResponse | None:
        actor = user_actor(request.user)
        for node in queryset:
            remember(request, f"New token of node {node}", rotate_node_token(node, actor))
        return shown_once_page(request, "Node tokens rotated", "the tokens", self._changelist())

    def _changelist(self) -> str:
        return reverse("admin:fleet_node_changelist")


@admin.register(AgentSession)
class AgentSessionAdmin(admin.ModelAdmin[AgentSession]):
    """Read-only: agents write these rows (hello, status, heartbeats); the list shows each
    connection's health and load as its last heartbeat reported them."""

    list_display = [
        "node",
        "deployment_label",
        "health",
        "ready_versions",
        "queue_depth",
        "in_flight",
        "memory",
        "evicted",
        "gpu_use",
        "connected_at",
    ]
    list_filter = ["node", ("disconnected_at", admin.EmptyFieldListFilter), "deployment_name"]
    list_select_related = ["node"]
    search_fields = ["node__name", "deployment_name", "channel_name"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: AgentSession | None = None) -> bool:
        return False

    @admin.display(description="deployment", ordering="deployment_name")
    def deployment_label(self, session: AgentSession) -> str:
        return session.deployment_name or "– (run by hand)"

    @admin.display(description="health", ordering="-last_heartbeat_at")
    def health(self, session: AgentSession) -> str:
        if session.disconnected_at is not None:
            return f"gone {session.disconnected_at:%Y-%m-%d %H:%M:%S}"
        state, age = heartbeat_health(session.last_heartbeat_at, timezone.now())
        return f"{state} ({age:.0f} s)"

    @admin.display(description="queue")
    def queue_depth(self, session: AgentSession) -> int:
        return (session.stats or {}).get("queue_depth", 0)

    @admin.display(description="in flight")
    def in_flight(self, session: AgentSession) -> int:
        return (session.stats or {}).get("in_flight", 0)

    @admin.display(description="memory used / budget (MiB)")
    def memory(self, session: AgentSession) -> str:
        stats = session.stats or {}
        budget = stats.get("memory_budget_bytes") or session.memory_budget_bytes
        return f"{_mib(stats.get('memory_used_bytes'))} / {_mib(budget) if budget else '–'}"

    @admin.display(description="evicted")
    def evicted(self, session: AgentSession) -> str:
        return ", ".join(map(str, (session.stats or {}).get("evicted", []))) or "–"

    @admin.display(description="GPU use")
    def gpu_use(self, session: AgentSession) -> str:
        gpus = (session.stats or {}).get("gpus", [])
        if not gpus:
            return "no GPU"
        return "; ".join(
            f"{g.get('index', '?')}: {g.get('utilization_pct', 0):.0f} %, "
            f"{_mib(g.get('memory_used_bytes'))}/{_mib(g.get('memory_total_bytes'))} MiB"
            for g in gpus
        )


@admin.register(GatewayProcess)
class GatewayProcessAdmin(admin.ModelAdmin[GatewayProcess]):
    """Read-only: each gateway process registers itself and the address agents' data links
    use; a row unseen for ``LIVE_S`` is a process that died without removing itself."""

    list_display = ["host", "link_url", "live", "started_at", "seen_at"]
    search_fields = ["host", "link_url"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: GatewayProcess | None = None
    ) -> bool:
        return False

    @admin.display(boolean=True, description="live")
    def live(self, process: GatewayProcess) -> bool:
        return timezone.now() - process.seen_at <= timedelta(seconds=LIVE_S)


def _mib(size: int | None) -> str:
    return f"{(size or 0) / MIB:,.0f}"


@admin.register(Pool)
class PoolAdmin(AuditedAdmin[Pool]):
    list_display = ["name", "backend", "namespace", "spot", "description", "deployment_count"]
    list_filter = ["spot", "backend"]
    search_fields = ["name", "description"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Pool]:
        return super().get_queryset(request).annotate(deployment_count=Count("deployments"))

    @admin.display(description="deployments", ordering="deployment_count")
    def deployment_count(self, pool: WithAnnotations[Pool, DeploymentCount]) -> int:
        return pool.deployment_count


DECISION_FIELDS = ("created_at", "current", "desired", "accepted", "dry_run", "reason", "error")


class DecisionInline(admin.TabularInline[ScalingDecision, Deployment]):
    """The last minutes only: at one decision per control-loop pass a day holds thousands; the
    scaling decisions' own list has them all."""

    model = ScalingDecision
    extra = 0
    can_delete = False
    max_num = 0
    fields = DECISION_FIELDS
    readonly_fields = DECISION_FIELDS
    ordering = ["-created_at"]
    verbose_name_plural = f"scaling decisions of the last {INLINE_DECISIONS_MIN} minutes"

    def get_queryset(self, request: HttpRequest) -> QuerySet[ScalingDecision]:
        since = timezone.now() - timedelta(minutes=INLINE_DECISIONS_MIN)
        return super().get_queryset(request).filter(created_at__gte=since)


# Only the autoscaler writes these; the cluster name follows the version, so changing the
# version (or the pool, or the tenant) of a running deployment would orphan its replicas.
AUTOSCALER_FIELDS = [
    "desired_replicas",
    "cluster_name",
    "woken_at",
    "last_active_at",
    "applied_template",
    "updated_at",
]


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin[Deployment]):
    """Changes go through the same functions as the API (audited, locked, saving only what
    changed); ``desired_replicas`` is read-only: only the autoscaler moves it, after the
    cluster accepted the scale. Live replicas are the agents connected for it now."""

    list_display = [
        "__str__",
        "tenant",
        "pool",
        "min_replicas",
        "max_replicas",
        "desired_replicas",
        "live_replicas",
        "last_active_at",
    ]
    list_filter = ["pool", "tenant", "isolation"]
    list_select_related = ["tenant", "pool", "version__model__tenant"]
    inlines = [DecisionInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Deployment]:
        horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD_AGENT_STALE_S)
        live = Q(sessions__disconnected_at__isnull=True, sessions__last_heartbeat_at__gte=horizon)
        return super().get_queryset(request).annotate(live=Count("sessions", filter=live))

    def get_readonly_fields(self, request: HttpRequest, obj: Deployment | None = None) -> list[str]:
        identity = ["tenant", "version", "pool"] if obj else ["tenant"]  # tenant: the version's
        return [*identity, *AUTOSCALER_FIELDS]

    @admin.display(description="live replicas", ordering="live")
    def live_replicas(self, deployment: WithAnnotations[Deployment, LiveReplicas]) -> int:
        return deployment.live

    def save_model(self, request: HttpRequest, obj: Deployment, form: Any, change: bool) -> None:
        actor = user_actor(request.user)
        if change:
            update_deployment(obj, {f: form.cleaned_data[f] for f in form.changed_data}, actor)
            return
        values = {name: getattr(obj, name) for name in SETTINGS}
        created = create_deployment(obj.version, obj.pool, values, actor)
        obj.pk, obj.tenant_id = created.pk, created.tenant_id

    def has_delete_permission(self, request: HttpRequest, obj: Deployment | None = None) -> bool:
        # Its replicas would run on unscaled: the control loop scales only deployments it has
        # rows for. Scale it to zero first (min_replicas 0, then idle).
        return obj is None or (obj.desired_replicas == 0 and not getattr(obj, "live", 0))

    def delete_model(self, request: HttpRequest, obj: Deployment) -> None:
        delete_deployment(obj, user_actor(request.user))

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # a bulk delete would skip the check above
        return actions


@admin.register(ScalingDecision)
class ScalingDecisionAdmin(admin.ModelAdmin[ScalingDecision]):
    list_display = [
        "created_at",
        "deployment",
        "current",
        "desired",
        "accepted",
        "dry_run",
        "reason",
        "error",
    ]
    list_filter = ["dry_run", "deployment__pool", "deployment"]
    list_select_related = ["deployment__version__model__tenant", "deployment__pool"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: ScalingDecision | None = None
    ) -> bool:
        return False
