"""``make_*`` helpers that fill in defaults, in the style of djangoproject.com's factories."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from fleet.models import AgentSession, Node
from registry.models import Model, ModelVersion, TaskKind
from registry.services import create_version, set_alias
from tenants.audit import Actor
from tenants.keys import create_api_key
from tenants.models import ApiKey, Membership, Quota, Tenant


def make_tenant(slug: str, rps: float = 1000.0, burst: int = 2000) -> Tenant:
    tenant = Tenant.objects.create(slug=slug, name=slug.title())
    Quota.objects.create(tenant=tenant, requests_per_second=rps, burst=burst)
    return tenant


def make_key(
    tenant: Tenant,
    name: str = "test key",
    scopes: tuple[str, ...] = ("predict", "deploy"),
    creator: User | None = None,
    **details: Any,
) -> tuple[ApiKey, str]:
    """A key of ``tenant`` acting as ``creator`` (by default the tenant's "key owner", an
    engineer), able to infer and deploy unless told otherwise."""
    if creator is None:
        creator = key_owner(tenant)
    role = Membership.objects.filter(tenant=tenant, user=creator).values_list("role", flat=True)
    actor = Actor(creator.pk, creator.get_username(), role.first() or "")
    return create_api_key(tenant, name, actor, scopes=scopes, **details)


def key_owner(tenant: Tenant) -> User:
    """The engineer who makes a tenant's test keys (created once per tenant)."""
    username = f"key-owner-{tenant.slug}"
    user = get_user_model().objects.filter(username=username).first()
    return user or make_member(tenant, username, "engineer")


def make_member(tenant: Tenant, username: str, role: str) -> User:
    user = get_user_model().objects.create_user(username, password=f"pw-{username}-1")
    Membership.objects.create(tenant=tenant, user=user, role=role)
    return user


# The admin's version form, filled as an upload leaves it (tests of the admin post it).
ADMIN_VERSION_FIELDS = {
    "max_batch_size": 8,
    "max_queue_delay_ms": 0,
    "max_queue": 64,
    "max_queue_per_caller": 0,
    "device": "auto",
    "max_input_tokens": 512,
    "max_output_tokens": 256,
    "max_streams": 16,
    "personal_fields": "{}",
    "offline_metrics": "{}",
    "feature_names": "[]",
}


def make_model(tenant: Tenant, name: str = "clf", task: str = TaskKind.CLASSIFIER) -> Model:
    return Model.objects.create(tenant=tenant, name=name, task=task)


def make_version(
    model: Model, artifact: bytes, alias: str | None = "production", **details: Any
) -> ModelVersion:
    version = create_version(model, artifact, **details)
    if alias:
        set_alias(model, alias, version)
    return version


def make_session(
    node: Node, deployment_name: str = "", budget_bytes: int = 0, channel: str = ""
) -> AgentSession:
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


def as_user(user: User, tenant_slug: str = "alpha") -> APIClient:
    """An API client signed in as ``user``, acting in ``tenant_slug``."""
    client = APIClient()
    client.default_format = "json"
    client.force_login(user)
    client.credentials(HTTP_X_TENANT=tenant_slug)
    return client


def key_client(key: str) -> APIClient:
    """An API client calling with the raw API key ``key``."""
    client = APIClient()
    client.default_format = "json"
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def make_log(
    version: ModelVersion,
    request_id: str = "",
    *,
    inputs: dict[str, Any] | None = None,
    outputs: dict[str, Any] | None = None,
    scores: list[Any] | None = None,
    arm: str = "",
    status: int = 200,
    at: Any = None,
    latency_ms: float = 2.0,
    trace_id: str = "",
) -> dict[str, Any]:
    """A logged request of ``version``, written to the Parquet log now (one file)."""
    import uuid

    from django.utils import timezone

    from monitoring.prediction_log import write_records

    record = {
        "tenant_id": version.model.tenant_id,
        "model_id": version.model_id,
        "version_id": version.pk,
        "arm": arm,
        "request_id": request_id or uuid.uuid4().hex,
        "trace_id": trace_id,
        "inputs": inputs or {},
        "outputs": outputs or {},
        "scores": scores or [],
        "latency_ms": latency_ms,
        "status": status,
        "created_at": at or timezone.now(),
    }
    write_records([record])
    return record


def logged_rows(tenant_id: int | None = None) -> list[dict[str, Any]]:
    """Every row of the Parquet log (of one tenant, or of all), oldest first."""
    from monitoring.logstore import log_store
    from monitoring.prediction_log import PREDICTIONS, log_rows

    store = log_store()
    tenants = [tenant_id] if tenant_id is not None else store.tenants(PREDICTIONS)
    files = [f for t in tenants for f in store.files(PREDICTIONS, t)]
    table = store.query(PREDICTIONS, files, "SELECT * FROM log ORDER BY created_at, request_id")
    return log_rows(table)


def clear_log() -> None:
    """Delete every file of the Parquet log (the test's own directory)."""
    from monitoring.logstore import log_store

    store = log_store()
    store.fs.delete_dir_contents(store.base, missing_dir_ok=True)
