"""Serving nodes, their live agent connections, and the change counter the gateways watch."""

from django.db import models


class Node(models.Model):
    """A machine allowed to run a serving agent; it authenticates with a hashed token.

    A node with a tenant serves only that tenant's versions; one without serves every tenant.
    """

    name = models.CharField(max_length=100, unique=True)
    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="nodes"
    )
    token_prefix = models.CharField(max_length=16, unique=True, editable=False)
    token_hash = models.CharField(max_length=64, editable=False)
    enabled = models.BooleanField(default=True)
    facts = models.JSONField(default=dict, blank=True, editable=False)
    last_seen_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class AgentSession(models.Model):
    """One websocket connection of an agent to one gateway process.

    Other gateway processes read these rows to route requests through the channel layer to
    an agent they do not hold themselves.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="sessions")
    channel_name = models.CharField(max_length=200, unique=True)
    ready_versions = models.JSONField(default=list, blank=True)
    # Every version's last reported state: {version id: {"state", "detail", "memory_bytes"}}.
    version_states = models.JSONField(default=dict, blank=True)
    stats = models.JSONField(default=dict, blank=True)
    # The autoscaled deployment this replica says it was started for (empty: a node run by
    # hand, which serves what placement puts on it), and that deployment if it exists.
    deployment_name = models.CharField(max_length=63, blank=True)
    deployment = models.ForeignKey(
        "rollouts.Deployment",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="sessions",
    )
    memory_budget_bytes = models.BigIntegerField(default=0)
    connected_at = models.DateTimeField(auto_now_add=True)
    last_heartbeat_at = models.DateTimeField(auto_now_add=True)
    disconnected_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-connected_at"]

    def __str__(self) -> str:
        state = "gone" if self.disconnected_at else "live"
        return f"{self.node} via {self.channel_name} ({state})"


class ConfigGeneration(models.Model):
    """A single counter bumped whenever keys, quotas, models, versions, aliases or nodes change.

    Each gateway process polls it and drops its caches when it moves, so a change reaches the
    data path within the refresh interval without a query per request.
    """

    value = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"generation {self.value}"
