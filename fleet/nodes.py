"""Nodes and their agents' sessions: node tokens, the session each agent connection keeps up to
date (hello, heartbeats, version states), and which sessions are alive."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from monitoring import usage
from platform_site.tokens import hash_token, new_token, token_matches, token_prefix
from serving_agent.protocol import Hello, VersionStatus
from tenants.audit import SYSTEM, Actor, audit
from tenants.models import Tenant

from .changes import bump_generation
from .models import AgentSession, Deployment, Node, Pool

log = logging.getLogger(__name__)

NODE_KIND = "syn"
# How much of a version state's detail is kept: a progress line ("building environment: ...")
# is short; a failure keeps room for the error that says why (an installer's, a traceback's).
DETAIL_CHARS = 300
FAILED_DETAIL_CHARS = 2000


def create_node(name: str, tenant: Tenant | None = None, actor: Actor = SYSTEM) -> tuple[Node, str]:
    """Create a node, audited (a node of no tenant: a platform-wide event); the raw token is
    returned once and never stored."""
    prefix, raw = new_token(NODE_KIND)
    with transaction.atomic():
        node = Node.objects.create(
            name=name, tenant=tenant, token_prefix=prefix, token_hash=hash_token(raw)
        )
        after = {"tenant": tenant.slug if tenant else None, "token_prefix": prefix}
        audit(node.tenant_id, actor, "node.create", f"node {name}", after=after)
    return node, raw


def rotate_node_token(node: Node, actor: Actor = SYSTEM) -> str:
    """A new token for the node (the old one stops working), audited; returned once."""
    prefix, raw = new_token(NODE_KIND)
    with transaction.atomic():
        before = {"token_prefix": node.token_prefix}
        node.token_prefix, node.token_hash = prefix, hash_token(raw)
        node.save(update_fields=["token_prefix", "token_hash"])
        after = {"token_prefix": prefix}
        audit(node.tenant_id, actor, "node.rotate_token", f"node {node.name}", before, after)
    return raw


def authenticate_node(raw: str | None) -> Node | None:
    prefix = token_prefix(raw or "", NODE_KIND)
    if prefix is None:
        return None
    node = Node.objects.filter(token_prefix=prefix, enabled=True).first()
    if node is None or not token_matches(raw or "", node.token_hash):
        return None
    return node


def live_sessions() -> QuerySet[AgentSession]:
    horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD_AGENT_STALE_S)
    return AgentSession.objects.filter(disconnected_at__isnull=True, last_heartbeat_at__gte=horizon)


def find_deployment(name: str) -> Deployment | None:
    """The deployment a replica names (its cluster name, ``sy-agent-<pk>-v<version>``)."""
    prefix, _, rest = name.partition("sy-agent-")
    pk = rest.split("-", 1)[0]
    if prefix or not pk.isdigit():
        return None
    found = Deployment.objects.select_related("version__model", "pool").filter(pk=int(pk)).first()
    return found if found is not None and found.cluster_name == name else None


class ClaimRefused(Exception):
    """An agent claimed what its node may not have: the connection is refused."""


def open_session(node: Node, channel_name: str, hello: Hello) -> AgentSession:
    """Record a connection's hello. A replica naming a deployment of a tenant outside its
    node's scope is refused: it would count in that deployment's scaling signal."""
    name = hello.deployment or ""
    deployment = find_deployment(name) if name else None
    if deployment is not None and node.tenant_id not in (None, deployment.tenant_id):
        raise ClaimRefused(f"node {node} may not run deployment {name!r} of another tenant")
    node.facts = hello.model_dump(exclude={"type"})
    node.last_seen_at = timezone.now()
    node.save(update_fields=["facts", "last_seen_at"])  # bumps the generation: placement reruns
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


def record_heartbeat(session_id: int, node_id: int, stats: dict[str, Any]) -> None:
    now = timezone.now()
    with transaction.atomic():
        previous = AgentSession.objects.filter(pk=session_id).values_list("stats", flat=True)
        usage.record_compute(previous.first() or {}, stats, now)  # compute since the last one
        AgentSession.objects.filter(pk=session_id).update(stats=stats, last_heartbeat_at=now)
    Node.objects.filter(pk=node_id).update(last_seen_at=now)


def record_version_state(session_id: int, status: VersionStatus, ready: list[int]) -> None:
    """Store a version's state on this connection; an eviction reruns placement."""
    session = AgentSession.objects.filter(pk=session_id).first()
    if session is None:
        return
    states = dict(session.version_states)
    limit = FAILED_DETAIL_CHARS if status.state == "failed" else DETAIL_CHARS
    states[str(status.version_id)] = {
        "state": status.state,
        "detail": status.detail[:limit],
        "memory_bytes": status.memory_bytes,
        "provider": status.provider,  # what really runs it: CUDA asked for may run on CPU
    }
    AgentSession.objects.filter(pk=session_id).update(
        ready_versions=sorted(ready), version_states=states, last_heartbeat_at=timezone.now()
    )
    if status.state == "evicted" and not session.deployment_name:
        bump_generation()


def record_ready(session_id: int, ready: list[int]) -> None:
    """The versions this connection may be sent requests for now (after its assignment
    changed); other gateway processes route by this row."""
    AgentSession.objects.filter(pk=session_id).update(ready_versions=sorted(ready))


def close_session(session_id: int) -> None:
    AgentSession.objects.filter(pk=session_id).update(disconnected_at=timezone.now())
    if AgentSession.objects.filter(pk=session_id, deployment_name="").exists():
        bump_generation()  # placement moves what it served onto the agents still here


def mark_stale_sessions() -> int:
    """Close sessions whose gateway process died without closing them; returns how many."""
    horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD_AGENT_STALE_S)
    return AgentSession.objects.filter(
        disconnected_at__isnull=True, last_heartbeat_at__lt=horizon
    ).update(disconnected_at=timezone.now())


def reload_node(node_id: int) -> Node | None:
    return Node.objects.filter(pk=node_id).first()


class LiveAgent(NamedTuple):
    """An agent connection alive in some gateway process, and what it may be sent."""

    session_id: int
    node_id: int
    channel_name: str
    ready: list[int]
    spot: bool = False  # a replica of a deployment on a spot pool


def live_agents() -> list[LiveAgent]:
    """The agent connections alive in any gateway process (their main connections): what
    ``live_sessions`` holds on enabled nodes. Plain SQL (the same join the ORM made): every
    gateway process reads it twice a second with Redis, and at rest the ORM's building of
    the query was most of the web process's CPU (bench/idle_bench.py)."""
    horizon = timezone.now() - timedelta(seconds=settings.SWITCHYARD_AGENT_STALE_S)
    session, node = AgentSession._meta.db_table, Node._meta.db_table
    deployment, pool = Deployment._meta.db_table, Pool._meta.db_table
    sql = (
        f"SELECT s.id, s.node_id, s.channel_name, s.ready_versions, p.spot FROM {session} s "
        f"JOIN {node} n ON n.id = s.node_id "
        f"LEFT JOIN {deployment} d ON d.id = s.deployment_id "
        f"LEFT JOIN {pool} p ON p.id = d.pool_id "
        "WHERE s.disconnected_at IS NULL AND s.last_heartbeat_at >= %s AND n.enabled"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [connection.ops.adapt_datetimefield_value(horizon)])
        rows = cursor.fetchall()
    # ready_versions is JSON: a list from PostgreSQL's driver, text from SQLite's.
    return [
        LiveAgent(
            pk,
            node_id,
            channel,
            ready if isinstance(ready, list) else json.loads(ready),
            bool(spot),
        )
        for pk, node_id, channel, ready, spot in rows
    ]


def session_spot(session_id: int) -> bool:
    """Whether the session is a replica of a deployment on a spot pool: its links carry the
    flag, so that dispatch prefers or avoids them without a query per request."""
    return bool(
        AgentSession.objects.filter(pk=session_id)
        .values_list("deployment__pool__spot", flat=True)
        .first()
    )


def attached_ready(node: Node, session_id: int) -> list[int] | None:
    """What a data link of ``node`` attached to session ``session_id`` may serve: that
    session's ready versions, if it is a live session of the same node (a node token never
    reaches another node's versions); else None."""
    return (
        live_sessions()
        .filter(pk=session_id, node=node, node__enabled=True)
        .values_list("ready_versions", flat=True)
        .first()
    )


def enabled_nodes(node_ids: Iterable[int]) -> set[int]:
    """Those of ``node_ids`` that exist and are enabled."""
    return set(
        Node.objects.filter(pk__in=list(node_ids), enabled=True).values_list("pk", flat=True)
    )
