"""The config generation and its change log: every change that the gateways cache or that
changes what agents are assigned moves the generation by one and writes a ``ConfigChange`` row
saying what it touched, in the same transaction. Every gateway process polls the generation
(``gateway.state``) and reads only the rows it has not seen, to drop only what they touch."""

from __future__ import annotations

from dataclasses import dataclass

from django.core.exceptions import ObjectDoesNotExist
from django.db import connection, transaction
from django.db.models import F
from django.db.models.signals import post_delete, post_save

from registry.models import Alias, Model, ModelVersion
from rollouts.models import PlanArm, RolloutPlan
from tenants.models import ApiKey, Quota, Tenant

from .models import ChangeKind, ConfigChange, ConfigGeneration, Deployment, Node, Pool

# Keys, quotas and routes are cached by the gateways; nodes, plans and deployments change which
# agent serves which version.
WATCHED = (
    ApiKey,
    Quota,
    Tenant,
    Model,
    ModelVersion,
    Alias,
    Node,
    RolloutPlan,
    PlanArm,
    Deployment,
    Pool,  # its spot flag: the links of its replicas carry it (gateway.dispatch)
)

# Rows kept: a gateway polls twice a second, so only one that stalled (or a burst of this many
# changes between two polls) falls behind them, and it then drops all its caches.
KEEP_CHANGES = 1000
PRUNE_EVERY = 100  # the change whose seq is a multiple of this deletes the rows past the window


@dataclass(frozen=True)
class Change:
    """What one change touched (a ``ConfigChange`` row, without its seq)."""

    kind: str  # a ChangeKind
    tenant_id: int | None = None
    object_id: int | None = None  # the key's id (KEY) or the model's (MODEL)
    name: str = ""  # the model's name (MODEL)


def change_of(instance: object) -> Change:
    """The scope of a save or delete of a watched row."""
    if isinstance(instance, ApiKey):
        return Change(ChangeKind.KEY, instance.tenant_id, instance.pk)
    if isinstance(instance, Tenant):
        return Change(ChangeKind.TENANT, instance.pk)
    if isinstance(instance, Quota):
        return Change(ChangeKind.TENANT, instance.tenant_id)
    try:
        if isinstance(instance, Model):
            model = instance
        elif isinstance(instance, ModelVersion | Alias | RolloutPlan):
            model = instance.model
        elif isinstance(instance, PlanArm):
            model = instance.plan.model
        else:
            return Change(ChangeKind.FLEET)
    except ObjectDoesNotExist:  # its model is gone already: say everything changed
        return Change(ChangeKind.ALL)
    return Change(ChangeKind.MODEL, model.tenant_id, model.pk, model.name)


def record_change(change: Change) -> int:
    """Move the generation by one and log what moved it; returns the new generation."""
    with transaction.atomic():
        # The update's row lock is held until the commit, so generations are taken in commit
        # order: a gateway that has read up to n never later finds a row below n committed.
        if not ConfigGeneration.objects.filter(pk=1).update(value=F("value") + 1):
            ConfigGeneration.objects.get_or_create(pk=1)
            ConfigGeneration.objects.filter(pk=1).update(value=F("value") + 1)
        seq = ConfigGeneration.objects.values_list("value", flat=True).get(pk=1)
        ConfigChange.objects.create(
            seq=seq,
            kind=change.kind,
            tenant_id=change.tenant_id,
            object_id=change.object_id,
            name=change.name,
        )
        if seq % PRUNE_EVERY == 0:
            ConfigChange.objects.filter(seq__lte=seq - KEEP_CHANGES).delete()
    return seq


def bump_generation() -> None:
    """A fleet change no watched row records (an agent session closed or evicted a version):
    the gateways re-push their agents' assignments and drop no cached entry."""
    record_change(Change(ChangeKind.FLEET))


def read_generation() -> int:
    # Plain SQL: every gateway process asks this twice a second, and at rest the ORM's
    # building of the query was most of the web process's CPU (bench/idle_bench.py).
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT value FROM {ConfigGeneration._meta.db_table} WHERE id = 1")
        row = cursor.fetchone()
    return int(row[0]) if row else 0


def changes_since(seen: int | None) -> tuple[int, list[Change] | None]:
    """The generation now and the changes after ``seen``, oldest first; None for the changes
    when some can no longer be read (pruned, or ``seen`` is not a generation this database
    had): the caller then drops everything. One query when nothing changed."""
    now = read_generation()
    if seen is None or now == seen:
        return now, []
    if now < seen or now - seen > KEEP_CHANGES:
        return now, None
    rows = ConfigChange.objects.filter(seq__gt=seen, seq__lte=now).values_list(
        "kind", "tenant_id", "object_id", "name"
    )
    changes = [Change(*row) for row in rows]
    # Every generation has its row, so a gap means rows were pruned (or written by code that
    # moved the counter alone): what this process missed is unknown.
    return now, changes if len(changes) == now - seen else None


def _on_change(instance: object, **_: object) -> None:
    record_change(change_of(instance))


def watch_changes() -> None:
    """Connect the change log to every save and delete of the watched models (once: the
    dispatch uid keeps a second call from connecting it twice)."""
    for model in WATCHED:
        post_save.connect(_on_change, sender=model, dispatch_uid=f"gen-save-{model.__name__}")
        post_delete.connect(_on_change, sender=model, dispatch_uid=f"gen-delete-{model.__name__}")
