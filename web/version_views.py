"""A version's page: its signature and settings, for a python version what its package holds
(``registry.python_package``), and its load state on each agent that may serve it, with the
detail that explains it (a python environment building, or the installer's error)."""

from __future__ import annotations

from django.http import HttpResponse

from fleet.deployments import version_placements
from registry.access import model_for, version_for
from registry.python_package import package_summary

from .pages import TenantRequest, page, tenant_view

FILE_ROWS = 200  # the package's files listed on the page; the API lists them all


@tenant_view
def version_detail(request: TenantRequest, name: str, version: int) -> HttpResponse:
    found = version_for(model_for(request.membership.tenant_id, name), version)
    package = package_summary(found)
    files = (package or {}).get("files") or []
    return page(
        request,
        "version.html",
        {
            "model": found.model,
            "version": found,
            "aliases": found.aliases.order_by("name"),
            "package": package,
            "files": files[:FILE_ROWS],
            "more_files": max(len(files) - FILE_ROWS, 0),
            "placements": version_placements(found),
        },
    )
