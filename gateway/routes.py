"""Resolving a model name and a version number or alias name to the version that serves it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from platform_site.errors import NotFound
from registry.access import model_for, version_for
from registry.formats import DEFAULT_FORMAT, FORMATS
from registry.graph_spec import Graph
from registry.graphs import stored_graph
from registry.models import Alias, ModelVersion
from registry.signature import check_default_answer
from serving_agent.protocol import OIP_TO_NUMPY

DEFAULT_ALIAS = "production"


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    dtype: np.dtype
    shape: tuple[int, ...]
    # The version takes NaN as a missing value here (ModelVersion.allow_missing).
    allow_missing: bool = False
    # A BYTES input the agent tokenizes (the version has a tokenizer): must be UTF-8 text.
    text: bool = False


@dataclass(frozen=True)
class Route:
    """Everything the data path needs about one servable version, cached per process."""

    tenant_id: int
    model_name: str
    version_id: int
    model_id: int
    version: int
    task: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[dict[str, Any], ...]
    feature_names: tuple[str, ...]
    # Text generation: streamed tokens instead of tensors, within the version's token limits.
    generates_text: bool = False
    # The agent tokenizes the prompt and renders chats itself (registry.formats).
    tokenizes_on_agent: bool = False
    # OIP model metadata's ``platform``: the runtime that serves the version's format.
    platform: str = FORMATS[DEFAULT_FORMAT].platform
    max_input_tokens: int = 0
    max_output_tokens: int = 0
    # Prediction logging: the share sampled, and {field: "redact" | "hash"} applied first.
    log_sample_rate: float = 0.0
    personal_fields: tuple[tuple[str, str], ...] = ()
    # The model's fallback ladder (registry.models.Model): the version that answers when this
    # one fails (never this one), each step's timeout, and the default answer, decoded.
    fallback_version_id: int | None = None
    primary_timeout_ms: int | None = None
    fallback_timeout_ms: int | None = None
    default_outputs: tuple[tuple[str, np.ndarray], ...] = field(default=(), compare=False)
    # The alias the request named (its rollout plan splits the traffic), or None when it
    # named a version number (answered by that version alone).
    alias: str | None = None
    # A graph version (a composed format): the gateway runs it node by node (gateway.graphs)
    # instead of sending it to an agent.
    graph: Graph | None = field(default=None, compare=False)
    # The most rows the agent runs in one batch: requests grouped into one frame stay within it.
    max_batch_size: int = 32

    @property
    def degrades(self) -> bool:
        return self.fallback_version_id is not None or bool(self.default_outputs)

    def input(self, name: str) -> InputSpec | None:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o["name"] for o in self.outputs)


class RouteMissing(Exception):
    """Nothing to serve: the message says what is missing (always answered as 404)."""


def route_of(version: ModelVersion) -> Route:
    log_sample_rate = version.model.log_sample_rate
    personal_fields = tuple(sorted(version.personal_fields.items()))
    fmt = version.format_entry
    if fmt.generates_text:
        return Route(
            tenant_id=version.model.tenant_id,
            model_name=version.model.name,
            version_id=version.pk,
            model_id=version.model_id,
            version=version.version,
            task=version.model.task,
            inputs=(),
            outputs=tuple(version.outputs),
            feature_names=(),
            generates_text=True,
            tokenizes_on_agent=fmt.tokenizes_on_agent,
            platform=fmt.platform,
            max_input_tokens=version.max_input_tokens,
            max_output_tokens=version.max_output_tokens,
            log_sample_rate=log_sample_rate,
            personal_fields=personal_fields,
        )
    model = version.model
    fallback = model.fallback_version_id
    return Route(
        tenant_id=model.tenant_id,
        model_name=model.name,
        version_id=version.pk,
        model_id=version.model_id,
        version=version.version,
        task=model.task,
        inputs=tuple(
            InputSpec(
                t["name"],
                t["datatype"],
                OIP_TO_NUMPY[t["datatype"]],
                tuple(t["shape"]),
                allow_missing=version.allow_missing,
                text=bool(version.tokenizer) and t["datatype"] == "BYTES",
            )
            for t in version.inputs
        ),
        outputs=tuple(version.outputs),
        feature_names=tuple(version.feature_names),
        platform=fmt.platform,
        max_batch_size=version.max_batch_size,
        log_sample_rate=log_sample_rate,
        personal_fields=personal_fields,
        fallback_version_id=fallback if fallback != version.pk else None,
        primary_timeout_ms=model.primary_timeout_ms,
        fallback_timeout_ms=model.fallback_timeout_ms,
        default_outputs=tuple(check_default_answer(model.default_answer))
        if model.default_answer
        else (),
        graph=stored_graph(version),
    )


def resolve_route(tenant_id: int, model_name: str, target: int | str) -> Route:
    """The version a model of this tenant serves for ``target``: a version number, or an
    alias name (``production``, ``staging``, ...)."""
    try:
        model = model_for(tenant_id, model_name)
        if isinstance(target, int):
            return route_of(version_for(model, target))
    except NotFound as exc:
        raise RouteMissing(str(exc)) from None
    alias = Alias.objects.select_related("version__model").filter(model=model, name=target).first()
    if alias is None:
        if target == DEFAULT_ALIAS:
            raise RouteMissing(f"model {model_name!r} has no {DEFAULT_ALIAS!r} version yet")
        raise RouteMissing(f"model {model_name!r} has no alias {target!r}")
    return replace(route_of(alias.version), alias=target)


def resolve_version_id(tenant_id: int, version_id: int) -> Route:
    """The route of one version by id (an arm of a rollout plan), within the tenant."""
    try:
        version = ModelVersion.objects.select_related("model").get(
            pk=version_id, model__tenant_id=tenant_id
        )
    except ModelVersion.DoesNotExist:
        raise RouteMissing(f"version id {version_id} not found") from None
    return route_of(version)
