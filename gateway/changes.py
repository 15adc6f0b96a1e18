"""The config generation: bumped on every change the data path caches, polled by gateways."""

from django.db.models import F
from django.db.models.signals import post_delete, post_save

from .models import ConfigGeneration


def bump_generation(**_: object) -> None:
    updated = ConfigGeneration.objects.filter(pk=1).update(value=F("value") + 1)
    if not updated:
        ConfigGeneration.objects.get_or_create(pk=1, defaults={"value": 1})


def read_generation() -> int:
    row = ConfigGeneration.objects.filter(pk=1).values_list("value", flat=True).first()
    return row or 0


def watch_changes() -> None:
    """Connect the bump to every model whose rows the gateway caches."""
    from registry.models import Alias, Model, ModelVersion
    from rollouts.models import Deployment, PlanArm, RolloutPlan
    from tenants.models import ApiKey, Quota, Tenant

    from .models import Node

    # Deployments change which agents serve a version (replicas, not hand-run nodes).
    watched = (ApiKey, Quota, Tenant, Model, ModelVersion, Alias, Node, RolloutPlan, PlanArm)
    for model in (*watched, Deployment):
        post_save.connect(bump_generation, sender=model, dispatch_uid=f"gen-save-{model.__name__}")
        post_delete.connect(
            bump_generation, sender=model, dispatch_uid=f"gen-delete-{model.__name__}"
        )
