"""Admin for nodes (a new token is shown once) and their live agent sessions."""

from django.contrib import admin, messages

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


@admin.register(AgentSession)
class AgentSessionAdmin(admin.ModelAdmin):
    list_display = [
        "node",
        "channel_name",
        "ready_versions",
        "last_heartbeat_at",
        "disconnected_at",
    ]
    list_filter = ["node"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
