"""Node tokens, agent sessions and what each node must serve."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Q, QuerySet
from django.utils import timezone

from platform_site.tokens import hash_token, new_token, token_matches, token_prefix
from registry.models import ModelVersion
from registry.services import served_versions
from rollouts.routing import versions_in_active_plans
from serving_agent.protocol import ARTIFACT_PATH, GenerationLimits, Hello, TensorSpec, VersionSpec

from .models import AgentSession, Node

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
    )


def assigned_versions(node: Node) -> QuerySet[ModelVersion]:
    """What a node serves, within its tenant scope: every version an alias points at, and every
    version an active rollout plan routes or copies to."""
    in_plans = versions_in_active_plans(node.tenant_id)
    aliased = served_versions(node.tenant_id).values_list("pk", flat=True)
    return (
        ModelVersion.objects.filter(Q(pk__in=list(aliased)) | Q(pk__in=in_plans))
        .select_related("model")
        .order_by("pk")
    )


def assignment_for(node: Node) -> list[VersionSpec]:
    return [version_spec(v) for v in assigned_versions(node)]


def may_download(node: Node, version_id: int) -> bool:
    """Agents only get artifacts of versions assigned to them."""
    return assigned_versions(node).filter(pk=version_id).exists()


def open_session(node: Node, channel_name: str, hello: Hello) -> AgentSession:
    node.facts = hello.model_dump(exclude={"type"})
    node.last_seen_at = timezone.now()
    node.save(update_fields=["facts", "last_seen_at"])
    session, _ = AgentSession.objects.update_or_create(
        channel_name=channel_name, defaults={"node": node, "disconnected_at": None}
    )
    return session


def record_heartbeat(session_id: int, node_id: int, stats: dict) -> None:
    now = timezone.now()
    AgentSession.objects.filter(pk=session_id).update(stats=stats, last_heartbeat_at=now)
    Node.objects.filter(pk=node_id).update(last_seen_at=now)


def record_ready_versions(session_id: int, ready: list[int]) -> None:
    AgentSession.objects.filter(pk=session_id).update(
        ready_versions=sorted(ready), last_heartbeat_at=timezone.now()
    )


def close_session(session_id: int) -> None:
    AgentSession.objects.filter(pk=session_id).update(disconnected_at=timezone.now())


def live_sessions() -> list[tuple[str, list[int]]]:
    """(channel name, ready version ids) of agent connections that are alive anywhere."""
    horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD["AGENT_STALE_S"])
    return list(
        AgentSession.objects.filter(
            disconnected_at__isnull=True, last_heartbeat_at__gte=horizon
        ).values_list("channel_name", "ready_versions")
    )


def mark_stale_sessions() -> int:
    """Close sessions whose gateway process died without closing them; returns how many."""
    horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD["AGENT_STALE_S"])
    return AgentSession.objects.filter(
        disconnected_at__isnull=True, last_heartbeat_at__lt=horizon
    ).update(disconnected_at=timezone.now())


def reload_node(node_id: int) -> Node | None:
    return Node.objects.filter(pk=node_id).first()
