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


class TrafficSample(models.Model):
    """What one gateway process saw of one version over one flush interval.

    Guardrails compare arms by summing these rows over a window: request and error counts and a
    latency histogram (bucket upper bounds in ``gateway.traffic.LATENCY_BOUNDS_MS``).
    """

    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.CASCADE, related_name="traffic"
    )
    window_end = models.DateTimeField(db_index=True)
    requests = models.PositiveIntegerField()
    errors = models.PositiveIntegerField()
    latency_buckets = models.JSONField()

    class Meta:
        ordering = ["-window_end"]

    def __str__(self) -> str:
        return f"v{self.version_id} @ {self.window_end:%H:%M:%S}: {self.requests} req"


class PredictionLog(models.Model):
    """One sampled prediction: what went in and came out, as logged (personal data redacted).

    ``inputs`` holds columns: {feature or input name: [value per row]}; ``scores`` one number
    per row (a classifier's positive-class probability or a regressor's value) for drift on the
    scores and online quality. Written in batches off the request path (``gateway.predlog``).
    """

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    model = models.ForeignKey("registry.Model", on_delete=models.CASCADE, related_name="+")
    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.CASCADE, related_name="prediction_logs"
    )
    arm = models.CharField(max_length=50, blank=True)
    request_id = models.CharField(max_length=128)
    trace_id = models.CharField(max_length=32, blank=True)
    inputs = models.JSONField(default=dict)
    outputs = models.JSONField(default=dict)
    scores = models.JSONField(default=list)
    latency_ms = models.FloatField()
    status = models.PositiveSmallIntegerField()
    created_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["version", "created_at"], name="predlog_version_time"),
            models.Index(fields=["tenant", "request_id"], name="predlog_tenant_request"),
            models.Index(fields=["model", "created_at"], name="predlog_model_time"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} v{self.version_id} {self.status}"


class Feedback(models.Model):
    """A ground-truth label for a prediction, by request id; it may arrive before or long after
    the prediction's log row, and is joined to it when quality is computed. Sent again, the
    label is replaced (a correction)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    request_id = models.CharField(max_length=128)
    # A number or class index per row of the request (a list), or one value for one row.
    label = models.JSONField()
    received_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-received_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "request_id"], name="feedback_unique_per_request"
            )
        ]

    def __str__(self) -> str:
        return f"{self.request_id}: {self.label}"
