"""Graph versions against the registry: what a node names, as its tenant sees it, and which
versions agents must load for the graphs that are served (docs/graphs.md). The document itself
is ``registry.graph_spec``."""

from __future__ import annotations

from collections.abc import Iterable

from platform_site.errors import NotFound

from .access import alias_for, model_for, version_for
from .formats import FORMATS
from .graph_spec import Graph, NodeMissing, Target, parse
from .models import ModelVersion


def node_target(tenant_id: int, model: str, target: int | str) -> Target:
    """The version a graph node names, looked up through the tenant (another tenant's model is
    "not found", as one that does not exist): the format table's ``compose`` lookup."""
    try:
        found = model_for(tenant_id, model)
        version = version_for(found, target) if isinstance(target, int) else None
        if version is None:
            version = alias_for(found, str(target)).version
    except NotFound as exc:
        raise NodeMissing(str(exc)) from None
    return Target(
        version.pk,
        version.version,
        version.inputs,
        version.outputs,
        version.generates_text,
        stored_graph(version),
    )


def stored_graph(version: ModelVersion) -> Graph | None:
    """The graph a composed version runs (kept at upload in ``lineage["graph"]``), else None."""
    if version.format_entry.compose is None:
        return None
    return parse(version.lineage["graph"])


def composed_formats() -> list[str]:
    return [value for value, entry in FORMATS.items() if entry.compose is not None]


def agent_version_ids(ids: Iterable[int]) -> set[int]:
    """The versions agents must load to serve ``ids``: each graph among them replaced by the
    versions its nodes name now (a pinned version, an alias's current version), nested graphs
    expanded in turn. A graph runs on the gateway, so no agent loads the graph itself; its
    nodes must be loaded even when no alias of their own points at them."""
    wanted = set(ids)
    seen: set[int] = set()
    pending = set(
        ModelVersion.objects.filter(pk__in=wanted, format__in=composed_formats()).values_list(
            "pk", flat=True
        )
    )
    while pending:
        seen |= pending
        wanted -= pending
        nodes: set[int] = set()
        for graph_version in ModelVersion.objects.filter(pk__in=pending).select_related("model"):
            graph = stored_graph(graph_version)
            assert graph is not None  # selected by its format
            for node in graph.nodes:
                try:
                    target = node_target(graph_version.model.tenant_id, node.model, node.target)
                except NodeMissing:
                    continue  # the graph answers 502 naming the node until it is fixed
                if target.graph is None:
                    wanted.add(target.version_id)
                else:
                    nodes.add(target.version_id)
        pending = nodes - seen
    return wanted
