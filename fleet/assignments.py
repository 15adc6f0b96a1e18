"""What each agent connection serves: the versions in its node's tenant scope, its deployment's
version for a replica, and for a node run by hand what placement (``fleet.placement``) puts on
it by memory; and the spec each agent receives for a version.
"""

from __future__ import annotations

import logging
from typing import Literal, cast

from django.conf import settings
from django.db.models import QuerySet
from django.db.models.fields.files import FieldFile

from registry.graphs import agent_version_ids
from registry.models import ModelVersion
from registry.services import served_versions
from rollouts.routing import versions_in_active_plans
from serving_agent.protocol import (
    ARTIFACT_PATH,
    TOKENIZER_PATH,
    GenerationLimits,
    TensorSpec,
    VersionSpec,
)

from .models import AgentSession, Deployment, Node
from .nodes import live_sessions
from .placement import Candidate, Item, place

log = logging.getLogger(__name__)

# A version's memory need before any agent measured it: its artifact's size times this, as
# runtimes hold the weights plus working buffers.
ESTIMATE_FACTOR = 2


# Agents --------------------------------------------------------------------------------------


def deployed_version_ids() -> set[int]:
    return set(Deployment.objects.values_list("version_id", flat=True))


def measured_needs() -> dict[int, int]:
    """Each version's largest footprint any live agent measured while loading it. Only figures
    for versions the platform accepted a state of from that agent count (an agent's state of a
    version it was never assigned is refused): an agent must not inflate another tenant's
    version until placement finds no room for it."""
    needs: dict[int, int] = {}
    for stats, states in live_sessions().values_list("stats", "version_states"):
        for load in (stats or {}).get("versions", []):
            vid, size = load.get("version_id"), load.get("memory_bytes") or 0
            known = isinstance(vid, int) and str(vid) in (states or {})
            if known and isinstance(size, int) and size > needs.get(vid, 0):
                needs[vid] = size
    return needs


def need_of(version: ModelVersion, measured: dict[int, int]) -> int:
    if version.pk in measured:
        return measured[version.pk]
    try:
        return version.artifact.size * ESTIMATE_FACTOR
    except (OSError, ValueError):  # the file is missing: loading it will fail anyway
        return 0


def placed_versions(
    session_id: int, scope_versions: dict[int | None, list[ModelVersion]]
) -> list[int]:
    """The versions placement gives this node-run-by-hand session, among every live one's.

    ``scope_versions`` maps each node scope (a tenant id, None for all) to the undeployed
    versions served in it.
    """
    by_hand = live_sessions().filter(deployment_name="")
    sessions = (by_hand | AgentSession.objects.filter(pk=session_id)).select_related("node")
    measured = measured_needs()
    items: dict[int, Item] = {}
    for versions in scope_versions.values():
        for v in versions:
            items[v.pk] = Item(v.pk, need_of(v, measured), v.model.tenant_id)
    candidates = [
        Candidate(
            key=s.pk,
            budget_bytes=s.memory_budget_bytes,
            holds=frozenset(s.ready_versions),
            evicted=frozenset((s.stats or {}).get("evicted", [])),
            scope=s.node.tenant_id,
        )
        for s in sessions
    ]
    placement = place(items.values(), candidates)
    if placement.unplaced:
        log.warning("versions %s fit on no agent's memory budget", placement.unplaced)
    return placement.assigned.get(session_id, [])


def download_url(file: FieldFile, platform_path: str) -> str:
    """Where an agent fetches a stored file: with S3 storage a presigned GET straight from the
    bucket (expiring after ``SWITCHYARD_S3_URL_EXPIRY_S``; the agent sends no credentials of its
    own there and verifies the sha256), so artifacts never pass through the platform;
    otherwise the platform's own download path (node token required)."""
    if settings.SWITCHYARD_STORAGE == "s3":
        return str(file.url)  # signed locally by boto3: no request to the bucket
    return platform_path


def version_spec(version: ModelVersion) -> VersionSpec:
    return VersionSpec(
        version_id=version.pk,
        model=version.model.name,
        version=version.version,
        sha256=version.sha256,
        artifact_url=download_url(version.artifact, ARTIFACT_PATH.format(version_id=version.pk)),
        inputs=[TensorSpec(**t) for t in version.inputs],
        outputs=[TensorSpec(**t) for t in version.outputs],
        max_batch_size=version.max_batch_size,
        max_queue_delay_ms=version.max_queue_delay_ms,
        max_queue=version.max_queue,
        max_queue_per_caller=version.max_queue_per_caller,
        # Django types a field with choices as str; this field's choices are the protocol's
        # values, which pydantic checks again here.
        device=cast(Literal["auto", "cpu", "cuda"], version.device),
        format=version.format,
        generation=GenerationLimits(
            max_input_tokens=version.max_input_tokens,
            max_output_tokens=version.max_output_tokens,
            max_streams=version.max_streams,
        )
        if version.generates_text
        else None,
        memory_bytes=need_of(version, {}),
        allow_missing=version.allow_missing,
        tokenizer_url=download_url(version.tokenizer, TOKENIZER_PATH.format(version_id=version.pk))
        if version.tokenizer
        else "",
        tokenizer_sha256=version.tokenizer_sha256,
        tenant_id=version.model.tenant_id,
    )


def scope_versions(node: Node) -> QuerySet[ModelVersion]:
    """Every version served within a node's tenant scope: those an alias points at, those an
    active rollout plan routes or copies to, and those with a deployment; a graph among them
    stands for the versions its nodes name (the gateway runs the graph itself)."""
    in_plans = versions_in_active_plans(node.tenant_id)
    aliased = served_versions(node.tenant_id).values_list("pk", flat=True)
    deployed = Deployment.objects.values_list("version_id", flat=True)
    if node.tenant_id is not None:
        deployed = deployed.filter(tenant_id=node.tenant_id)
    wanted = agent_version_ids({*aliased, *in_plans, *deployed})
    return ModelVersion.objects.filter(pk__in=wanted).select_related("model").order_by("pk")


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
    deployed = deployed_version_ids()
    undeployed = [v for v in in_scope if v.pk not in deployed]
    scopes = {node.tenant_id: undeployed}
    for other in Node.objects.filter(sessions__in=live_sessions()).exclude(pk=node.pk):
        if other.tenant_id not in scopes:
            scopes[other.tenant_id] = [v for v in scope_versions(other) if v.pk not in deployed]
    placed = set(placed_versions(session.pk, scopes))
    return [v for v in undeployed if v.pk in placed]


def assignment_for(node: Node, session_id: int) -> list[VersionSpec]:
    session = AgentSession.objects.get(pk=session_id)
    return [version_spec(v) for v in assigned_versions(node, session)]


def may_download(node: Node, version_id: int) -> bool:
    """Agents only get artifacts of versions served in their scope."""
    return scope_versions(node).filter(pk=version_id).exists()
