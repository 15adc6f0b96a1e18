"""Pools from a file: the Helm chart renders its ``gpuPools`` value as ``pools.json`` (a list of
``fleet.Pool`` rows' fields), and ``manage.py sync_pools`` makes the rows say the same.

A pool in the file is created or updated to match; a pool missing from the file is left alone
(it may carry deployments, and the admin may have made it), unless ``prune`` is asked and no
deployment uses it. Every change is audited in the transaction that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from tenants.admin_audit import snapshot
from tenants.audit import Actor, audit

from .models import Pool

FIELDS = (
    "name",
    "backend",
    "namespace",
    "image",
    "node_selector",
    "tolerations",
    "description",
    "spot",
)


class PoolFileError(ValueError):
    """The file is not a list of pools; the message names the entry and the field."""


@dataclass
class SyncResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # not in the file, still used: not pruned


def parse_pools(data: Any) -> list[Pool]:
    """Unsaved ``Pool`` objects for the file's entries, each checked like the admin's form
    would (slug, lengths, backend) plus the JSON fields' shapes, or a ``PoolFileError``."""
    if not isinstance(data, list):
        raise PoolFileError("pools file: expected a JSON list of pools")
    pools: list[Pool] = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        where = f"pools[{i}]"
        if not isinstance(entry, dict):
            raise PoolFileError(f"{where}: expected an object")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise PoolFileError(f"{where}: unknown field(s) {', '.join(unknown)}")
        selector = entry.get("node_selector", {})
        if not isinstance(selector, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
        ):
            raise PoolFileError(f"{where}.node_selector: expected an object of strings")
        tolerations = entry.get("tolerations", [])
        if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
            raise PoolFileError(f"{where}.tolerations: expected a list of objects")
        for name in ("name", "backend", "namespace", "image", "description"):
            if name in entry and not isinstance(entry[name], str):
                raise PoolFileError(f"{where}.{name}: expected a string")
        if "spot" in entry and not isinstance(entry["spot"], bool):
            raise PoolFileError(f"{where}.spot: expected true or false")
        pool = Pool(**entry)
        try:
            pool.full_clean(validate_unique=False)
        except ValidationError as exc:
            problems = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
            raise PoolFileError(f"{where}: {problems}") from None
        if pool.name in seen:
            raise PoolFileError(f"{where}.name: {pool.name!r} appears twice")
        seen.add(pool.name)
        pools.append(pool)
    return pools


def sync_pools(wanted: list[Pool], actor: Actor, prune: bool = False) -> SyncResult:
    """Make the Pool rows match ``wanted`` (from ``parse_pools``), all or nothing."""
    result = SyncResult()
    with transaction.atomic():
        existing = {p.name: p for p in Pool.objects.select_for_update()}
        for pool in wanted:
            current = existing.get(pool.name)
            after = {k: getattr(pool, k) for k in FIELDS}
            if current is None:
                pool.save()
                audit(None, actor, "pool.create", f"pool {pool.name}", after=snapshot(pool))
                result.created.append(pool.name)
                continue
            before = {k: getattr(current, k) for k in FIELDS}
            if before == after:
                result.unchanged.append(pool.name)
                continue
            for key, value in after.items():
                setattr(current, key, value)
            current.save()
            diff = [k for k in FIELDS if before[k] != after[k]]
            audit(
                None,
                actor,
                "pool.update",
                f"pool {pool.name}",
                {k: before[k] for k in diff},
                {k: after[k] for k in diff},
            )
            result.updated.append(pool.name)
        if prune:
            names = {p.name for p in wanted}
            for name, pool in sorted(existing.items()):
                if name in names:
                    continue
                if pool.deployments.exists():
                    result.kept.append(name)
                    continue
                audit(None, actor, "pool.delete", f"pool {name}", before=snapshot(pool))
                pool.delete()
                result.pruned.append(name)
    return result
