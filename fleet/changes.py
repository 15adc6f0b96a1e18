"""The config generation: one counter bumped on every change that the gateways cache or that
changes what agents are assigned, polled by every gateway process (``gateway.state``)."""

from django.db.models import F
from django.db.models.signals import post_delete, post_save

from registry.models import Alias, Model, ModelVersion
from rollouts.models import PlanArm, RolloutPlan
from tenants.models import ApiKey, Quota, Tenant

from .models import ConfigGeneration, Deployment, Node, Pool

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


def bump_generation(**_: object) -> None:
    updated = ConfigGeneration.objects.filter(pk=1).update(value=F("value") + 1)
    if not updated:
        ConfigGeneration.objects.get_or_create(pk=1, defaults={"value": 1})


def read_generation() -> int:
    row = ConfigGeneration.objects.filter(pk=1).values_list("value", flat=True).first()
    return row or 0


def watch_changes() -> None:
    """Connect the bump to every save and delete of the watched models (once: the dispatch
    uid keeps a second call from connecting it twice)."""
    for model in WATCHED:
        post_save.connect(bump_generation, sender=model, dispatch_uid=f"gen-save-{model.__name__}")
        post_delete.connect(
            bump_generation, sender=model, dispatch_uid=f"gen-delete-{model.__name__}"
        )
