"""The web UI's right-sizing page of a model: the measured replica utilisation, batch
occupancy, queue time and cost per 1,000 predictions of its served versions, and the
recommendations they justify (``fleet.rightsizing``, the same report the API answers)."""

from __future__ import annotations

from django.http import HttpResponse

from fleet.rightsizing import report
from registry.access import model_for

from .pages import TenantRequest, page, tenant_view


@tenant_view
def model_rightsizing(request: TenantRequest, name: str) -> HttpResponse:
    model = model_for(request.membership.tenant_id, name)
    return page(request, "rightsizing.html", {"model": model, "report": report(model)})
