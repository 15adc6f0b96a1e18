"""Admin for nodes (a new token is shown once) and their live agent sessions."""

from django.contrib import admin, messages
from django.utils import timezone

from rollouts.deployments import heartbeat_health

from .models import AgentSession, Node
from .nodes import create_node, rotate_node_token


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "enabled", "last_seen_at"]
    readonly_fields = ["token_prefix", "facts", "last_seen_at", "created_at"]
    actions = ["rotate_token"]

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        node, raw = create_node(obj.name, obj.tenant)
        obj.pk = node.pk
        messages.warning(
            request,
            f"Node created. Start its agent with: python -m serving_agent --platform "
            f"{request.scheme}://{request.get_host()} --token {raw} (shown once)",
        )

    @admin.action(description="Rotate the token of the selected node")
    def rotate_token(self, request, queryset):
        for node in queryset:
            messages.warning(
                request, f"New token for {node}: {rotate_node_token(node)} (shown once)"
            )


MIB = 1 << 20


@admin.register(AgentSession)
class AgentSessionAdmin(admin.ModelAdmin):
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

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
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


def _mib(size: int | None) -> str:
    return f"{(size or 0) / MIB:,.0f}"
