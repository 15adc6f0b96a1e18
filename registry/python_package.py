"""What a ``python`` version's package holds, for people to read (the version page, the API's
``.../package``): its files, pinned requirements and wheels, and the manifest's entrypoint,
resources and policy. Read from the stored artifact with ``serving_agent.package`` (the one
reader of a package): nothing in it runs here.
"""

from __future__ import annotations

from typing import Any

from django.core.cache import cache

from serving_agent.package import Package, PackageError, read_package

from .models import ModelVersion

# The format value of a python package (its entry in registry.formats.FORMATS), and of one
# whose class streams text.
PYTHON_FORMAT = "python"
PYTHON_GENERATOR_FORMAT = "python_generator"
# A version is immutable: its summary is cached by its artifact's digest, for a day.
CACHE_S = 24 * 3600


def is_python_package(version: ModelVersion) -> bool:
    return version.format in (PYTHON_FORMAT, PYTHON_GENERATOR_FORMAT)


def package_summary(version: ModelVersion) -> dict[str, Any] | None:
    """The package of a python version (``None`` for any other format). A package the
    registry cannot read now (its stored file missing or unreadable) is a summary with only
    ``error`` set, so a page still shows the rest of the version."""
    if not is_python_package(version):
        return None
    key = f"switchyard:python-package:{version.sha256}"
    found = cache.get(key)
    if isinstance(found, dict):
        return found
    try:
        with version.artifact.open("rb") as handle:
            summary = describe(read_package(handle))
    except PackageError as exc:  # it passed this check when uploaded: the reader changed
        summary = {"error": f"the package cannot be read: {exc}"}
    except OSError as exc:  # the store: not cached, it may come back
        return {"error": f"the stored artifact cannot be opened: {exc}"}
    cache.set(key, summary, CACHE_S)
    return summary


def describe(package: Package) -> dict[str, Any]:
    manifest = package.manifest
    files = sorted(package.members, key=lambda m: m.name)
    return {
        "error": None,
        "entrypoint": manifest.entrypoint,
        "generates": manifest.generates,
        "features": list(manifest.features),
        "resources": {
            "memory_mib": manifest.memory_mib,
            "cpus": manifest.cpus,
            "timeout_s": manifest.timeout_s,
        },
        "policy": {"network": manifest.network},
        "requirements": list(package.requirements),
        "wheels": [{"name": n, "sha256": d} for n, d in sorted(package.wheels.items())],
        "files": [{"name": m.name, "size": m.size} for m in files],
        "total_bytes": sum(m.size for m in files),
    }
