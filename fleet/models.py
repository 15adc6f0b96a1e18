"""The fleet's records: nodes allowed to run agents and each agent connection's session, the
config generation the gateways and agents follow, pools, deployments and the autoscaler's
decisions.

The tables were made by the gateway and rollouts apps and moved here with their rows (each
model keeps its ``db_table``).
"""

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone


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
        db_table = "gateway_node"  # made by the gateway app, moved here with its rows
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
    # Every version's last reported state:
    # {version id: {"state", "detail", "memory_bytes", "provider"}}.
    version_states = models.JSONField(default=dict, blank=True)
    stats = models.JSONField(default=dict, blank=True)
    # The autoscaled deployment this replica says it was started for (empty: a node run by
    # hand, which serves what placement puts on it), and that deployment if it exists.
    deployment_name = models.CharField(max_length=63, blank=True)
    deployment = models.ForeignKey(
        "fleet.Deployment",
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
        db_table = "gateway_agentsession"  # made by the gateway app, moved here with its rows
        ordering = ["-connected_at"]

    def __str__(self) -> str:
        state = "gone" if self.disconnected_at else "live"
        return f"{self.node} via {self.channel_name} ({state})"


class GatewayProcess(models.Model):
    """A live gateway process and the address where agents open a data link to it.

    Every gateway process registers itself when it starts, marks itself seen from its refresh
    loop and removes itself when it stops; agents keep a link to each live one, so a request
    reaches an agent in the process that received it.
    """

    key = models.CharField(max_length=32, unique=True)  # random per process start
    link_url = models.CharField(max_length=300)
    host = models.CharField(max_length=200, blank=True)  # hostname and pid, for operators
    started_at = models.DateTimeField(auto_now_add=True)
    seen_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["started_at"]
        verbose_name_plural = "gateway processes"

    def __str__(self) -> str:
        return f"{self.host or self.key} at {self.link_url}"


class ConfigGeneration(models.Model):
    """A single counter bumped whenever keys, quotas, models, versions, aliases or nodes change:
    the sequence number of the newest ``ConfigChange``.

    Each gateway process polls it and, when it moves, reads the changes it has not seen and
    drops only the cache entries they touch, so a change reaches the data path within the
    refresh interval without a query per request.
    """

    value = models.BigIntegerField(default=0)

    class Meta:
        db_table = "gateway_configgeneration"  # made by the gateway app, moved here with its rows

    def __str__(self) -> str:
        return f"generation {self.value}"


class ChangeKind(models.TextChoices):
    """What a config change touches, and so which cached entries a gateway drops."""

    KEY = "key", "one API key"  # that key's cached identity
    TENANT = "tenant", "a tenant or its quota"  # that tenant's identities and routes
    MODEL = "model", "a model, version, alias or rollout plan"  # that model's routes
    FLEET = "fleet", "nodes, pools, deployments"  # no cached entry: agent assignments only
    ALL = "all", "anything"  # a change whose scope is unknown: every cached entry


class ConfigChange(models.Model):
    """One change behind a move of the config generation (``seq`` is the generation it moved
    to), so a gateway drops what it touched instead of every cache. Only the newest rows are
    kept (``fleet.changes.KEEP_CHANGES``); a gateway further behind drops everything.

    No foreign keys: a row outlives the tenant or model it names (their deletion is a change).
    """

    seq = models.BigIntegerField(primary_key=True)
    kind = models.CharField(max_length=8, choices=ChangeKind.choices)
    tenant_id = models.BigIntegerField(null=True, blank=True)
    object_id = models.BigIntegerField(null=True, blank=True)  # the key's or the model's id
    name = models.CharField(max_length=100, blank=True)  # the model's name

    class Meta:
        ordering = ["seq"]

    def __str__(self) -> str:
        return f"change {self.seq}: {self.kind} {self.tenant_id} {self.object_id} {self.name}"


class ClusterKind(models.TextChoices):
    LOCAL = "local", "Local agent processes"
    KUBERNETES = "kubernetes", "Kubernetes"


class Pool(models.Model):
    """Where agent replicas run: a kind of node (``gpu-a100``, ``gpu-mig-1g``, ``cpu``) and the
    backend that starts them there."""

    name = models.SlugField(max_length=63, unique=True)
    backend = models.CharField(max_length=12, choices=ClusterKind.choices)
    namespace = models.CharField(max_length=63, default="switchyard")
    image = models.CharField(max_length=200, blank=True)
    node_selector = models.JSONField(default=dict, blank=True)
    tolerations = models.JSONField(default=list, blank=True)
    description = models.CharField(max_length=200, blank=True)
    # Spot / preemptible capacity: cheaper, but a replica may be taken away at any moment.
    # Batch-class requests prefer agents here; every other request avoids them when it can.
    spot = models.BooleanField(
        default=False, help_text="spot or preemptible nodes: batch work prefers them"
    )

    class Meta:
        db_table = "rollouts_pool"  # made by the rollouts app, moved here with its rows

    def __str__(self) -> str:
        return f"{self.name} ({self.backend})"


class Isolation(models.TextChoices):
    SHARED = "shared", "Shared pool, within the tenant's quota"
    DEDICATED = "dedicated", "Dedicated nodes"


class Deployment(models.Model):
    """A model version running on a pool, between ``min_replicas`` and ``max_replicas``.

    ``desired_replicas`` is only ever what the cluster backend accepted, so the database never
    claims a scale the cluster refused.
    """

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="deployments"
    )
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="deployments")
    min_replicas = models.PositiveIntegerField(default=0)
    max_replicas = models.PositiveIntegerField(default=4, validators=[MinValueValidator(1)])
    target_load_per_replica = models.FloatField(default=8.0, validators=[MinValueValidator(0.01)])
    slo_p99_ms = models.FloatField(null=True, blank=True, validators=[MinValueValidator(1)])
    scale_down_window_s = models.PositiveIntegerField(default=120)
    idle_to_zero_s = models.PositiveIntegerField(default=300)
    cpu = models.CharField(max_length=20, default="1")
    memory = models.CharField(max_length=20, default="2Gi")
    gpus = models.PositiveIntegerField(default=0)
    mig_profile = models.CharField(max_length=20, blank=True)
    isolation = models.CharField(max_length=10, choices=Isolation.choices, default=Isolation.SHARED)
    desired_replicas = models.PositiveIntegerField(default=0)
    # The gateway's last request for this version while no replica was ready (a cold start).
    woken_at = models.DateTimeField(null=True, blank=True)
    # When its replicas last served (or the gateway held) a request: scale to zero counts
    # idleness from here.
    last_active_at = models.DateTimeField(default=timezone.now)
    # Hash of the agent template last applied to the cluster; a change re-applies it.
    applied_template = models.CharField(max_length=64, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "rollouts_deployment"  # made by the rollouts app, moved here with its rows
        constraints = [
            models.UniqueConstraint(
                fields=["version", "pool"],
                name="one_deployment_per_version_and_pool",
                violation_error_message="This version already has a deployment on this pool.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.version} on {self.pool.name}"

    def clean(self) -> None:
        if self.min_replicas > self.max_replicas:
            raise ValidationError({"min_replicas": "must not exceed max_replicas"})

    @property
    def cluster_name(self) -> str:
        """The agent Deployment's name in the cluster (a DNS-1123 label)."""
        return f"sy-agent-{self.pk}-v{self.version.version}"


class ScalingDecision(models.Model):
    """One decision of the autoscaler: what it saw, what it wanted, what the cluster accepted."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="decisions")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)  # the decision's time
    current = models.PositiveIntegerField()
    desired = models.PositiveIntegerField()
    accepted = models.PositiveIntegerField(null=True, blank=True)  # None: refused or dry run
    dry_run = models.BooleanField(default=False)
    reason = models.CharField(max_length=300)
    inputs = models.JSONField(default=dict)
    error = models.CharField(max_length=300, blank=True)

    class Meta:
        db_table = "rollouts_scalingdecision"  # made by the rollouts app, moved here with its rows
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.deployment}: {self.current} → {self.desired} ({self.reason})"
