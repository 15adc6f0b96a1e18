"""What monitoring keeps: per-version traffic samples, the sampled prediction log and its
ground-truth feedback, drift reports and alerts.

The tables were made by the gateway and rollouts apps and moved here with their rows (each
model keeps its ``db_table``).
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone


class TrafficSample(models.Model):
    """What one gateway process saw of one version over one flush interval.

    Guardrails compare arms by summing these rows over a window: request and error counts, a
    coarse latency histogram (bucket upper bounds in ``monitoring.traffic.LATENCY_BOUNDS_MS``,
    read by index in SQL by the SLOs and charts) and a fine one (``latency_fine``: log-spaced
    buckets about 5 % wide, sparse, for the guardrails' quantile test). Requests a rollout plan
    routed carry the plan and arm, so two arms of an A/B plan are told apart even when they
    share a version; shadow copies are never counted here (``rollouts.ShadowSample``).
    """

    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.CASCADE, related_name="traffic"
    )
    window_end = models.DateTimeField(db_index=True)
    requests = models.PositiveIntegerField()
    errors = models.PositiveIntegerField()
    # Of the errors, those a lower step of the model's fallback ladder answered: the version
    # failed (guardrails count them), the client got a degraded answer (the SLOs do not).
    degraded = models.PositiveIntegerField(default=0)
    # Requests refused with 503 because no replica of the version was ready yet (an agent still
    # loading it, a cold start past its hold): not in ``requests`` or ``errors``, so a new
    # version's first requests never burn its error budget; shown as their own count.
    not_ready = models.PositiveIntegerField(default=0)
    latency_buckets = models.JSONField()
    # {fine bucket index (as a JSON key): count}; see monitoring.traffic.fine_index.
    latency_fine = models.JSONField(default=dict, blank=True)
    # The rollout plan (id: rollouts sits above monitoring) and arm that routed these requests;
    # null for requests no plan routed (no plan, or a version asked for explicitly).
    plan_id = models.PositiveIntegerField(null=True, blank=True)
    arm = models.CharField(max_length=50, blank=True, default="")
    # Usage: the rows (batch dimension) of the requests answered, and a generation's tokens in
    # and out (``monitoring.usage`` rolls them up per day).
    rows = models.PositiveBigIntegerField(default=0)
    tokens_in = models.PositiveBigIntegerField(default=0)
    tokens_out = models.PositiveBigIntegerField(default=0)

    class Meta:
        db_table = "gateway_trafficsample"  # made by the gateway app, moved here with its rows
        ordering = ["-window_end"]
        indexes = [
            models.Index(fields=["plan_id", "arm", "window_end"], name="traffic_plan_arm_time")
        ]

    def __str__(self) -> str:
        return f"v{self.version_id} @ {self.window_end:%H:%M:%S}: {self.requests} req"


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
        db_table = "gateway_feedback"  # made by the gateway app, moved here with its rows
        ordering = ["-received_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "request_id"], name="feedback_unique_per_request"
            )
        ]

    def __str__(self) -> str:
        return f"{self.request_id}: {self.label}"


class DriftReport(models.Model):
    """One run of the drift job on one version: each feature's and the scores' distance from
    the reference, and data-quality counts, over one window of logged predictions."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    model = models.ForeignKey(
        "registry.Model", on_delete=models.CASCADE, related_name="drift_reports"
    )
    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.CASCADE, related_name="drift_reports"
    )
    window_start = models.DateTimeField()
    window_end = models.DateTimeField()
    reference_source = models.CharField(max_length=10)
    rows_current = models.PositiveIntegerField()
    rows_reference = models.PositiveIntegerField()
    threshold = models.FloatField()
    # {feature: {"kind": "numeric"|"categorical", "psi", "ks", "ks_pvalue" | "distance",
    #  "flagged", "edges" | "categories", "reference", "current" (histogram shares)}}
    features = models.JSONField(default=dict)
    score = models.JSONField(null=True, blank=True)  # the same shape, on the output scores
    # {feature: {"nulls", "out_of_range", "schema"}} counted in the current window.
    quality = models.JSONField(default=dict)
    flagged = models.JSONField(default=list)  # feature names (and "score") past the threshold
    max_psi = models.FloatField(default=0.0)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        db_table = "rollouts_driftreport"  # made by the rollouts app, moved here with its rows
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["version", "created_at"], name="drift_version_time")]

    def __str__(self) -> str:
        return f"drift v{self.version_id} @ {self.created_at:%Y-%m-%d %H:%M}: {self.flagged}"


class AlertKind(models.TextChoices):
    DRIFT = "drift", "Drift"
    SLO_BURN = "slo_burn", "SLO burn"
    ROLLBACK = "rollback", "Rollback"
    STALLED = "stalled", "Rollout stalled"
    BUDGET = "budget", "Budget"


class Alert(models.Model):
    """Something an operator should see: shown in the UI until resolved, and posted to the
    tenant's webhook (Slack-compatible) with retries. ``key`` folds repeats of one condition
    into one open alert."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="alerts")
    model = models.ForeignKey(
        "registry.Model", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    kind = models.CharField(max_length=10, choices=AlertKind.choices)
    severity = models.CharField(
        max_length=10, choices=[("warning", "Warning"), ("critical", "Critical")]
    )
    key = models.CharField(max_length=200)
    title = models.CharField(max_length=200)
    message = models.TextField()
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    last_seen_at = models.DateTimeField(default=timezone.now)
    resolved_at = models.DateTimeField(null=True, blank=True)
    webhook_state = models.CharField(
        max_length=10,
        default="none",
        choices=[
            ("none", "No webhook"),
            ("pending", "Pending"),
            ("sent", "Sent"),
            ("failed", "Failed"),
        ],
    )
    webhook_attempts = models.PositiveSmallIntegerField(default=0)
    webhook_error = models.CharField(max_length=300, blank=True)

    class Meta:
        db_table = "rollouts_alert"  # made by the rollouts app, moved here with its rows
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "key"],
                condition=Q(resolved_at__isnull=True),
                name="one_open_alert_per_key",
            )
        ]

    def __str__(self) -> str:
        return f"[{self.severity}] {self.title}"


class Resource(models.TextChoices):
    """What usage is counted in, and priced by."""

    REQUEST = "request", "Requests"
    ROW = "row", "Rows"
    TOKEN_IN = "token_in", "Tokens in"
    TOKEN_OUT = "token_out", "Tokens out"
    CPU_SECOND = "cpu_second", "CPU-seconds"
    ACCEL_SECOND = "accel_second", "Accelerator-seconds"


class UsageDay(models.Model):
    """What one version served in one UTC day: rolled up by a beat task from the traffic
    samples and the agents' heartbeats (``monitoring.usage``), priced when rolled up."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    model = models.ForeignKey("registry.Model", on_delete=models.CASCADE, related_name="+")
    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.CASCADE, related_name="usage_days"
    )
    day = models.DateField(db_index=True)
    requests = models.PositiveBigIntegerField(default=0)
    rows = models.PositiveBigIntegerField(default=0)
    tokens_in = models.PositiveBigIntegerField(default=0)
    tokens_out = models.PositiveBigIntegerField(default=0)
    cpu_s = models.FloatField(default=0.0)
    accel_s = models.FloatField(default=0.0)
    cost = models.DecimalField(max_digits=18, decimal_places=6, default=0)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-day", "version_id"]
        constraints = [
            models.UniqueConstraint(fields=["version", "day"], name="one_usage_row_per_version_day")
        ]

    def __str__(self) -> str:
        return f"usage v{self.version_id} {self.day}: {self.requests} requests"


class ComputeDay(models.Model):
    """The compute one version took in one UTC day, as the agents measured it: the deltas of
    their heartbeats' totals, added as each heartbeat is stored (``monitoring.usage``)."""

    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.CASCADE, related_name="compute_days"
    )
    day = models.DateField(db_index=True)
    cpu_s = models.FloatField(default=0.0)
    accel_s = models.FloatField(default=0.0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["version", "day"], name="one_compute_row_per_version_day"
            )
        ]

    def __str__(self) -> str:
        return f"compute v{self.version_id} {self.day}: {self.cpu_s:.3f} CPU-s"


class Price(models.Model):
    """The price of one unit of a resource: a tenant's own (set by its approvers), or the
    platform's default (``tenant`` empty, set by operators)."""

    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    resource = models.CharField(max_length=20, choices=Resource.choices)
    unit_price = models.DecimalField(max_digits=18, decimal_places=9)
    currency = models.CharField(max_length=3, default="USD")
    set_by = models.ForeignKey(
        "auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    set_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "resource"], name="one_price_per_tenant_resource"
            ),
            models.UniqueConstraint(
                fields=["resource"],
                condition=Q(tenant__isnull=True),
                name="one_default_price_per_resource",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id or 'default'} {self.resource}: {self.unit_price}"


class Budget(models.Model):
    """A tenant's monthly budget: alerts at its thresholds (percent of ``monthly_limit``) and,
    with ``hard_stop``, new work refused once spent, until an approver's override ends."""

    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    monthly_limit = models.DecimalField(max_digits=18, decimal_places=2)
    currency = models.CharField(max_length=3, default="USD")
    thresholds = models.JSONField(default=list)  # percents, e.g. [50, 80, 100]
    hard_stop = models.BooleanField(default=False)
    # The month the figures below are for (its first day), what was spent in it at the last
    # roll-up, the thresholds already alerted in it, and whether new work is refused.
    month = models.DateField(null=True, blank=True)
    spent = models.DecimalField(max_digits=18, decimal_places=6, default=0)
    alerted = models.JSONField(default=list)
    stopped = models.BooleanField(default=False)
    override_until = models.DateTimeField(null=True, blank=True)
    override_by = models.ForeignKey(
        "auth.User", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"budget {self.tenant_id}: {self.spent}/{self.monthly_limit} {self.currency}"
