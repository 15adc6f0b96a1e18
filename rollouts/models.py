"""Rollout plans that move an alias's traffic between versions."""

from __future__ import annotations

from typing import Any

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
    # An A/B plan's outcome once the guardrails decide it: {"winner": arm name or null for "no
    # difference", "metric", "reason", "at"}; null while undecided (rollouts.guardrails).
    ab_result = models.JSONField(null=True, blank=True)
    # Every canary weight the plan ran at, in order ({"weight", "at"}): the timeline draws the
    # steps that ran as done, and those jumped over or never reached as such.
    weights_run = models.JSONField(default=list, blank=True)
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
    ARMS = "arms", "A/B arm weights"


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
    # An arms request: the A/B arms' new weights, {arm name: percent}.
    arm_weights = models.JSONField(null=True, blank=True)
    # Distinct approvers the request needs: the policy's N when the request was opened (a
    # policy changed later does not move the goalposts of a request already under review).
    approvals_needed = models.PositiveSmallIntegerField(default=1)
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
        if self.kind == RequestKind.WEIGHT:
            change = f"{self.weight:g}%"
        elif self.kind == RequestKind.ARMS:
            change = ", ".join(f"{k} {v:g}%" for k, v in (self.arm_weights or {}).items())
        else:
            change = f"v{self.to_version.version}"
        return f"#{self.pk} {self.kind} {self.model}@{self.alias} → {change} ({self.state})"

    @property
    def approvals_given(self) -> int:
        """Approvers who said yes so far (of ``approvals_needed``)."""
        return sum(1 for vote in self.votes.all() if vote.approved)

    def snapshot(self) -> dict[str, Any]:
        """The request as an audit event's before/after records it."""
        return {
            "state": self.state,
            "kind": self.kind,
            "from_version": self.from_version.version if self.from_version else None,
            "to_version": self.to_version.version,
            "weight": self.weight,
            "arm_weights": self.arm_weights,
            "plan": self.plan_id,
            "approvals_needed": self.approvals_needed,
        }


class ApprovalVote(models.Model):
    """One approver's yes (or no) on a request: a request needs ``approvals_needed`` distinct
    yeses, none from its requester; one no ends it."""

    request = models.ForeignKey(ApprovalRequest, on_delete=models.CASCADE, related_name="votes")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    label = models.CharField(max_length=150)
    approved = models.BooleanField()
    comment = models.TextField(blank=True)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["request", "at", "pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["request", "user"],
                name="one_vote_per_approver_and_request",
                violation_error_message="This approver has already voted on this request.",
            )
        ]

    def __str__(self) -> str:
        return f"#{self.request_id}: {self.label} {'yes' if self.approved else 'no'}"


def default_protected_aliases() -> list[str]:
    return ["production"]


class RolloutPolicy(models.Model):
    """What a tenant (``model`` null) or one of its models allows without an approval: the
    largest candidate weight on a protected alias, the guardrails every plan must set beyond
    the three always required, and how many approvers a request needs. Set by an approver."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    model = models.ForeignKey(
        "registry.Model", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    max_weight_without_approval = models.FloatField(
        default=10.0, validators=[MinValueValidator(0.0), MaxValueValidator(100.0)]
    )
    required_guardrails = models.JSONField(default=list, blank=True)
    approvals_needed = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(10)]
    )
    protected_aliases = models.JSONField(default=default_protected_aliases)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant"],
                condition=Q(model__isnull=True),
                name="one_default_policy_per_tenant",
                violation_error_message="This tenant already has a default rollout policy.",
            ),
            models.UniqueConstraint(
                fields=["model"],
                condition=Q(model__isnull=False),
                name="one_policy_per_model",
                violation_error_message="This model already has a rollout policy.",
            ),
        ]

    def __str__(self) -> str:
        scope = self.model.name if self.model is not None else "tenant default"
        return f"policy ({scope}): {self.max_weight_without_approval:g}% without approval"

    def snapshot(self) -> dict[str, Any]:
        """The policy as an audit event's before/after records it."""
        return {
            "max_weight_without_approval": self.max_weight_without_approval,
            "required_guardrails": list(self.required_guardrails),
            "approvals_needed": self.approvals_needed,
            "protected_aliases": list(self.protected_aliases),
        }


class FreezeOverride(models.Model):
    """An approver lets releases of a model go on while its error budget is spent, until
    ``expires_at``."""

    model = models.ForeignKey("registry.Model", on_delete=models.CASCADE, related_name="+")
    reason = models.TextField()
    expires_at = models.DateTimeField()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_label = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-expires_at"]

    def __str__(self) -> str:
        return f"freeze override on {self.model_id} until {self.expires_at:%Y-%m-%d %H:%M} UTC"


class ShadowSample(models.Model):
    """Shadow copies one gateway process ran for a plan over one flush interval."""

    plan = models.ForeignKey(RolloutPlan, on_delete=models.CASCADE, related_name="shadow_samples")
    window_end = models.DateTimeField()
    answered = models.PositiveIntegerField()
    agreed = models.PositiveIntegerField()
    failed = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"plan {self.plan_id}: {self.agreed}/{self.answered} agreed"
