"""Rollout plans that move an alias's traffic between versions."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone


class PlanMode(models.TextChoices):
    CANARY = "canary", "Canary"
    SHADOW = "shadow", "Shadow"
    AB = "ab", "A/B"


class PlanState(models.TextChoices):
    RUNNING = "running", "Running"
    PAUSED = "paused", "Paused"
    PROMOTED = "promoted", "Promoted"
    ROLLED_BACK = "rolled_back", "Rolled back"


ACTIVE_STATES = (PlanState.RUNNING, PlanState.PAUSED)


def default_steps() -> list[float]:
    return [1, 5, 25, 50, 100]


class RolloutPlan(models.Model):
    """Moves one alias of one model from ``baseline`` towards ``candidate``.

    Canary: the candidate gets ``weight`` percent of traffic. Shadow: the baseline answers and
    a ``shadow_sample`` share of requests is copied to the candidate after the reply. A/B: the
    plan's arms carry the weights. Assignment is sticky per routing key.
    """

    model = models.ForeignKey("registry.Model", on_delete=models.CASCADE, related_name="plans")
    alias = models.CharField(max_length=50, default="production")
    mode = models.CharField(max_length=10, choices=PlanMode.choices)
    state = models.CharField(max_length=12, choices=PlanState.choices, default=PlanState.RUNNING)
    baseline = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="+"
    )
    candidate = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="+"
    )
    weight = models.FloatField(
        default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(100.0)]
    )
    steps = models.JSONField(default=default_steps)
    # The highest weight a person may set directly; above it a weight change needs an approval.
    max_weight = models.FloatField(
        default=50.0, validators=[MinValueValidator(0.0), MaxValueValidator(100.0)]
    )
    bake_seconds = models.PositiveIntegerField(default=300)
    shadow_sample = models.FloatField(
        default=1.0, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)]
    )
    routing_header = models.CharField(max_length=100, default="x-user-id")
    guardrails = models.JSONField()
    # When the current weight took effect: guardrails compare arms from here, and bake from here.
    step_started_at = models.DateTimeField(default=timezone.now)
    # The guardrails' last word, shown in the UI and API ("waiting for data: 12/200 samples").
    status_note = models.CharField(max_length=300, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "alias"],
                condition=Q(state__in=["running", "paused"]),
                name="one_active_plan_per_alias",
                violation_error_message="This alias already has an active rollout plan.",
            )
        ]

    def __str__(self) -> str:
        versions = f"v{self.baseline.version}→v{self.candidate.version}"
        return f"{self.model}@{self.alias}: {self.mode} {versions}"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES


class PlanArm(models.Model):
    """One arm of an A/B plan: a version and its share of traffic."""

    plan = models.ForeignKey(RolloutPlan, on_delete=models.CASCADE, related_name="arms")
    name = models.CharField(max_length=50)
    version = models.ForeignKey("registry.ModelVersion", on_delete=models.PROTECT, related_name="+")
    weight = models.FloatField(validators=[MinValueValidator(0.0), MaxValueValidator(100.0)])

    class Meta:
        ordering = ["plan", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["plan", "name"],
                name="arm_name_unique_per_plan",
                violation_error_message="This plan already has an arm with this name.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name}: v{self.version.version} ({self.weight:g}%)"


class RequestKind(models.TextChoices):
    PROMOTION = "promotion", "Promotion"
    WEIGHT = "weight", "Weight change"


class RequestState(models.TextChoices):
    PENDING = "pending", "Pending"
    APPROVED = "approved", "Approved"  # a plan's promotion: waits for the plan's last step
    APPLIED = "applied", "Applied"
    REJECTED = "rejected", "Rejected"
    CANCELLED = "cancelled", "Cancelled"


OPEN_REQUEST_STATES = (RequestState.PENDING, RequestState.APPROVED)


class ApprovalRequest(models.Model):
    """A change that needs a second person: moving a protected alias (a promotion, directly or
    by a plan reaching 100 %) or a canary weight above the plan's ``max_weight``.

    Only a member with the approver role who is not the requester decides. The evidence is
    computed live while pending and frozen with the decision.
    """

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    model = models.ForeignKey(
        "registry.Model", on_delete=models.CASCADE, related_name="approval_requests"
    )
    alias = models.CharField(max_length=50)
    kind = models.CharField(max_length=10, choices=RequestKind.choices)
    state = models.CharField(
        max_length=10, choices=RequestState.choices, default=RequestState.PENDING
    )
    plan = models.ForeignKey(
        RolloutPlan, null=True, blank=True, on_delete=models.CASCADE, related_name="requests"
    )
    # What the alias pointed at when the request was made: if it moves, the request is stale.
    from_version = models.ForeignKey(
        "registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    to_version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="+"
    )
    weight = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0), MaxValueValidator(100.0)]
    )
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    requested_label = models.CharField(max_length=150)
    comment = models.TextField(blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_label = models.CharField(max_length=150, blank=True)
    decision_comment = models.TextField(blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    evidence = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "alias", "kind"],
                condition=Q(state__in=["pending", "approved"]),
                name="one_open_request_per_alias_and_kind",
                violation_error_message="This alias already has an open request of this kind.",
            )
        ]

    def __str__(self) -> str:
        change = (
            f"{self.weight:g}%"
            if self.kind == RequestKind.WEIGHT
            else f"v{self.to_version.version}"
        )
        return f"#{self.pk} {self.kind} {self.model}@{self.alias} → {change} ({self.state})"

    def snapshot(self) -> dict:
        """The request as an audit event's before/after records it."""
        return {
            "state": self.state,
            "kind": self.kind,
            "from_version": self.from_version.version if self.from_version else None,
            "to_version": self.to_version.version,
            "weight": self.weight,
            "plan": self.plan_id,
        }


class ShadowSample(models.Model):
    """Shadow copies one gateway process ran for a plan over one flush interval."""

    plan = models.ForeignKey(RolloutPlan, on_delete=models.CASCADE, related_name="shadow_samples")
    window_end = models.DateTimeField()
    answered = models.PositiveIntegerField()
    agreed = models.PositiveIntegerField()
    failed = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"plan {self.plan_id}: {self.agreed}/{self.answered} agreed"
