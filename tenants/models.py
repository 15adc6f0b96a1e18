"""Tenants, their members and roles, API keys (stored hashed), quotas and the audit log."""

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

# An API key's requests in flight at once per gateway process, unless set on the key: well
# above what one well-behaved client keeps open, far below what starves the other tenants.
DEFAULT_MAX_IN_FLIGHT = 64


class Tenant(models.Model):
    """A customer or team: owns models, keys and a quota; everything is scoped to one."""

    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=50, unique=True)
    # Alerts (drift, SLO burn, rollbacks) are also posted here as Slack-compatible JSON.
    alert_webhook_url = models.URLField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    ENGINEER = "engineer", "Engineer"
    APPROVER = "approver", "Approver"


# Roles that may change things (engineers act, approvers also decide); viewers only read.
WRITE_ROLES = frozenset({Role.ENGINEER, Role.APPROVER})


class Membership(models.Model):
    """A Django user's role within one tenant."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.VIEWER)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "user"],
                name="one_membership_per_user_and_tenant",
                violation_error_message="This user is already a member of this tenant.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class Quota(models.Model):
    """A tenant's request budget: ``burst`` tokens, refilled at ``requests_per_second``; and
    for text generation, concurrent streams and generated plus prompt tokens per minute; and the
    agent replicas its deployments may run on shared pools."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    requests_per_second = models.FloatField(default=100.0, validators=[MinValueValidator(0.001)])
    burst = models.PositiveIntegerField(default=200, validators=[MinValueValidator(1)])
    max_concurrent_streams = models.PositiveIntegerField(
        default=8, validators=[MinValueValidator(1)]
    )
    tokens_per_minute = models.PositiveIntegerField(
        default=60_000, validators=[MinValueValidator(1)]
    )
    # Agent replicas all of the tenant's deployments may run at once on shared pools (None:
    # no cap); the autoscaler holds a deployment below its own max to stay within it.
    max_replicas = models.PositiveIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.tenant}: {self.requests_per_second:g}/s, burst {self.burst}"


class KeyPriority(models.IntegerChoices):
    """The agents' priority classes (``serving_agent.protocol.PRIORITY_CLASSES``), best first."""

    CRITICAL = 0, "critical"
    INTERACTIVE = 1, "interactive"
    BATCH = 2, "batch"
    SHADOW = 3, "shadow"


class Scope(models.TextChoices):
    """What an API key may do. ``predict``: inference on every front door; ``deploy``: the
    control-plane writes engineers make (models, versions, plans, aliases); ``admin``: keys and
    tenant settings. Reads of the control-plane API need any scope."""

    PREDICT = "predict", "predict"
    DEPLOY = "deploy", "deploy"
    ADMIN = "admin", "admin"


SCOPES = tuple(Scope.values)


def default_scopes() -> list[str]:
    return [Scope.PREDICT]


def validate_scopes(value: object) -> None:
    if not isinstance(value, list) or not value:
        raise ValidationError("scopes must be a non-empty list of 'predict', 'deploy', 'admin'")
    unknown = [s for s in value if s not in SCOPES]
    if unknown:
        raise ValidationError(f"unknown scope(s) {unknown!r}; scopes are {list(SCOPES)}")


class ApiKey(models.Model):
    """A tenant's API key. Only a hash is kept; the short prefix finds the row without it.

    A key acts as the person who created it (``created_by``), within its ``scopes``; its scopes
    never change (rotate it for others), and after ``expires_at`` it is refused."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    key_hash = models.CharField(max_length=64, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="Refused from this time on (empty: never expires)."
    )
    scopes = models.JSONField(
        default=default_scopes,
        validators=[validate_scopes],
        help_text="What the key may do: predict, deploy, admin.",
    )
    last_used_at = models.DateTimeField(null=True, blank=True)
    # The scheduling class of this key's requests by default, and the best one they may ask
    # for (a request above it is refused): agents serve a better class first.
    priority = models.PositiveSmallIntegerField(
        choices=KeyPriority.choices,
        default=KeyPriority.INTERACTIVE,
        help_text="Default and highest priority class of this key's requests.",
    )
    # Bounds what one leaked or runaway client can hold of a gateway process: its requests
    # beyond this many at once are answered 429 at once instead of queueing.
    max_in_flight = models.PositiveIntegerField(
        default=DEFAULT_MAX_IN_FLIGHT,
        validators=[MinValueValidator(1), MaxValueValidator(100_000)],
        help_text="Most requests of this key in flight at once in each gateway process "
        "(over it: 429 with Retry-After).",
    )

    class Meta:
        verbose_name = "API key"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} (sy_{self.prefix}_…)"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and not self.is_expired

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if self.is_expired else "active"


class AppendOnly(ValidationError):
    """Raised by any attempt to change or delete an audit event."""

    def __init__(self) -> None:
        super().__init__("Audit events are append-only.")


class AuditEventQuerySet(models.QuerySet["AuditEvent"]):
    """Bulk changes refused as ``save()`` and ``delete()`` are (the database refuses them too:
    migration 0010's triggers)."""

    def update(self, **kwargs: Any) -> int:
        raise AppendOnly()

    def delete(self) -> tuple[int, dict[str, int]]:
        raise AppendOnly()

    def bulk_update(self, *args: Any, **kwargs: Any) -> int:
        raise AppendOnly()


class AuditEvent(models.Model):
    """An append-only record of a state change: who, what, before, after, why.

    It outlives its tenant and its actor: neither reference is a database constraint nor
    followed on delete, and the tenant's slug is copied into the row when it is written."""

    # DO_NOTHING without a constraint: deleting a tenant or a user leaves its history in place
    # (a SET_NULL would be an UPDATE, which the append-only trigger refuses).
    # None: a platform-wide change (a shared pool, a node of no tenant), seen in the admin.
    tenant = models.ForeignKey(
        Tenant,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="audit",
    )
    tenant_slug = models.CharField(max_length=50, blank=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="+",
    )
    actor_label = models.CharField(max_length=150)
    action = models.CharField(max_length=50)
    target = models.CharField(max_length=200)
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        db_table = "rollouts_auditevent"  # created by the rollouts app, moved here with its rows
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.pk is not None:
            raise AppendOnly()
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> tuple[int, dict[str, int]]:
        raise AppendOnly()


class IdempotencyRecord(models.Model):
    """The first answer to a state-changing API call sent with an ``Idempotency-Key``, kept for
    the retention window so a retry by the same caller gets it back instead of acting twice.

    ``status`` is null while the first call is still running (a retry then gets 409)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    caller = models.CharField(max_length=40)  # "key:<id>" or "user:<id>": keys are per caller
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)  # of the method, path and body
    status = models.PositiveSmallIntegerField(null=True, blank=True)
    headers = models.JSONField(default=list, blank=True)
    body = models.BinaryField(default=b"", blank=True)
    created_at = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "caller", "key"],
                name="idempotency_key_once_per_caller",
                violation_error_message="This Idempotency-Key is already in use by this caller.",
            )
        ]

    def __str__(self) -> str:
        return f"{self.caller} {self.key!r} ({self.status or 'in progress'})"
