"""``make_*`` helpers that fill in defaults, in the style of djangoproject.com's factories."""

from __future__ import annotations

from django.contrib.auth import get_user_model

from registry.models import Model, TaskKind
from registry.services import create_version, set_alias
from tenants.keys import create_api_key
from tenants.models import Membership, Quota, Tenant


def make_tenant(slug: str, rps: float = 1000.0, burst: int = 2000) -> Tenant:
    tenant = Tenant.objects.create(slug=slug, name=slug.title())
    Quota.objects.create(tenant=tenant, requests_per_second=rps, burst=burst)
    return tenant


def make_key(tenant: Tenant, name: str = "test key"):
    return create_api_key(tenant, name)


def make_member(tenant: Tenant, username: str, role: str):
    user = get_user_model().objects.create_user(username, password=f"pw-{username}-1")
    Membership.objects.create(tenant=tenant, user=user, role=role)
    return user


def make_model(tenant: Tenant, name: str = "clf", task: str = TaskKind.CLASSIFIER) -> Model:
    return Model.objects.create(tenant=tenant, name=name, task=task)


def make_version(model: Model, artifact: bytes, alias: str | None = "production", **details):
    version = create_version(model, artifact, **details)
    if alias:
        set_alias(model, alias, version)
    return version


def make_session(node, deployment_name: str = "", budget_bytes: int = 0, channel: str = ""):
    """A live agent connection of ``node``, as the consumer records it after the hello."""
    from fleet.nodes import open_session
    from serving_agent.protocol import Hello

    hello = Hello(
        agent_version="test",
        host="test",
        cpu_count=1,
        memory_bytes=1 << 30,
        deployment=deployment_name or None,
        memory_budget_bytes=budget_bytes,
    )
    return open_session(node, channel or f"test.{node.name}.{deployment_name}", hello)
