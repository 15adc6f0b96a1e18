"""Node tokens, agent sessions and what each node must serve."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db.models import Q, QuerySet
from django.utils import timezone

from platform_site.tokens import hash_token, new_token, token_matches, token_prefix
from registry.models import ModelVersion
from registry.services import served_versions
from rollouts import fleet
from rollouts.models import Deployment
from rollouts.routing import versions_in_active_plans
from serving_agent.protocol import (
    ARTIFACT_PATH,
    GenerationLimits,
    Hello,
    TensorSpec,
    VersionSpec,
    VersionStatus,
)

from .changes import bump_generation
from .models import AgentSession, Node

log = logging.getLogger(__name__)

NODE_KIND = "syn"


def create_node(name: str, tenant=None) -> tuple[Node, str]:
    """Create a node; the raw token is returned once and never stored."""
    prefix, raw = new_token(NODE_KIND)
    node = Node.objects.create(
        name=name, tenant=tenant, token_prefix=prefix, token_hash=hash_token(raw)
    )
    return node, raw


def rotate_node_token(node: Node) -> str:
    prefix, raw = new_token(NODE_KIND)
    node.token_prefix, node.token_hash = prefix, hash_token(raw)
    node.save(update_fields=["token_prefix", "token_hash"])
    return raw


def authenticate_node(raw: str | None) -> Node | None:
    prefix = token_prefix(raw or "", NODE_KIND)
    if prefix is None:
        return None
    node = Node.objects.filter(token_prefix=prefix, enabled=True).first()
    if node is None or not token_matches(raw or "", node.token_hash):
        return None
    return node


def version_spec(version: ModelVersion) -> VersionSpec:
    return VersionSpec(
        version_id=version.pk,
        model=version.model.name,
        version=version.version,
        sha256=version.sha256,
        artifact_url=ARTIFACT_PATH.format(version_id=version.pk),
        inputs=[TensorSpec(**t) for t in version.inputs],
        outputs=[TensorSpec(**t) for t in version.outputs],
        max_batch_size=version.max_batch_size,
        max_queue_delay_ms=version.max_queue_delay_ms,
        max_queue=version.max_queue,
        device=version.device,
        format=version.format,
        generation=GenerationLimits(
            max_input_tokens=version.max_input_tokens,
            max_output_tokens=version.max_output_tokens,
            max_streams=version.max_streams,
        )
        if version.generates_text
        else None,
        memory_bytes=fleet.need_of(version, {}),
    )


def scope_versions(node: Node) -> QuerySet[ModelVersion]:
    """Every version served within a node's tenant scope: those an alias points at, those an
    active rollout plan routes or copies to, and those with a deployment."""
    in_plans = versions_in_active_plans(node.tenant_id)
    aliased = served_versions(node.tenant_id).values_list("pk", flat=True)
    deployed = Deployment.objects.values_list("version_id", flat=True)
    if node.tenant_id is not None:
        deployed = deployed.filter(tenant_id=node.tenant_id)
    wanted = Q(pk__in=list(aliased)) | Q(pk__in=in_plans) | Q(pk__in=list(deployed))
    return ModelVersion.objects.filter(wanted).select_related("model").order_by("pk")


def assigned_versions(node: Node, session: AgentSession) -> list[ModelVersion]:
    """What one agent connection serves.

    A replica started for a deployment serves that deployment's version (if its node may
    serve the tenant). A node run by hand serves the versions without a deployment that
    placement puts on it by memory.
    """
    in_scope = scope_versions(node)
    if session.deployment_name:
        if session.deployment_id is None:
            return []  # it names no deployment we know: it serves nothing
        return list(in_scope.filter(deployments=session.deployment_id))
    deployed = fleet.deployed_version_ids()
    undeployed = [v for v in in_scope if v.pk not in deployed]
    scopes = {node.tenant_id: undeployed}
    for other in Node.objects.filter(sessions__in=fleet.live_sessions()).exclude(pk=node.pk):
        if other.tenant_id not in scopes:
            scopes[other.tenant_id] = [v for v in scope_versions(other) if v.pk not in deployed]
    placed = set(fleet.placed_versions(session.pk, scopes))
    return [v for v in undeployed if v.pk in placed]


def assignment_for(node: Node, session_id: int) -> list[VersionSpec]:
    session = AgentSession.objects.get(pk=session_id)
    return [version_spec(v) for v in assigned_versions(node, session)]


def may_download(node: Node, version_id: int) -> bool:
    """Agents only get artifacts of versions served in their scope."""
    return scope_versions(node).filter(pk=version_id).exists()


def open_session(node: Node, channel_name: str, hello: Hello) -> AgentSession:
    node.facts = hello.model_dump(exclude={"type"})
    node.last_seen_at = timezone.now()
    node.save(update_fields=["facts", "last_seen_at"])  # bumps the generation: placement reruns
    name = hello.deployment or ""
    deployment = fleet.find_deployment(name) if name else None
    if name and deployment is None:
        log.warning("agent on node %s names an unknown deployment %r", node, name)
    session, _ = AgentSession.objects.update_or_create(
        channel_name=channel_name,
        defaults={
            "node": node,
            "disconnected_at": None,
            "last_heartbeat_at": timezone.now(),
            "deployment_name": name,
            "deployment": deployment,
            "memory_budget_bytes": hello.memory_budget_bytes,
        },
    )
    return session


def record_heartbeat(session_id: int, node_id: int, stats: dict) -> None:
    now = timezone.now()
    AgentSession.objects.filter(pk=session_id).update(stats=stats, last_heartbeat_at=now)
    Node.objects.filter(pk=node_id).update(last_seen_at=now)


def record_version_state(session_id: int, status: VersionStatus, ready: list[int]) -> None:
    """Store a version's state on this connection; an eviction reruns placement."""
    session = AgentSession.objects.filter(pk=session_id).first()
    if session is None:
        return
    states = dict(session.version_states)
    states[str(status.version_id)] = {
        "state": status.state,
        "detail": status.detail[:300],
        "memory_bytes": status.memory_bytes,
    }
    AgentSession.objects.filter(pk=session_id).update(
        ready_versions=sorted(ready), version_states=states, last_heartbeat_at=timezone.now()
    )
    if status.state == "evicted" and not session.deployment_name:
        bump_generation()


def close_session(session_id: int) -> None:
    AgentSession.objects.filter(pk=session_id).update(disconnected_at=timezone.now())
    if AgentSession.objects.filter(pk=session_id, deployment_name="").exists():
        bump_generation()  # placement moves what it served onto the agents still here


def live_sessions() -> list[tuple[str, list[int]]]:
    """(channel name, ready version ids) of agent connections that are alive anywhere."""
    return list(fleet.live_sessions().values_list("channel_name", "ready_versions"))


def mark_stale_sessions() -> int:
    """Close sessions whose gateway process died without closing them; returns how many."""
    horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD["AGENT_STALE_S"])
    return AgentSession.objects.filter(
        disconnected_at__isnull=True, last_heartbeat_at__lt=horizon
    ).update(disconnected_at=timezone.now())


def reload_node(node_id: int) -> Node | None:
    return Node.objects.filter(pk=node_id).first()
