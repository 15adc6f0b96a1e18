"""An alias's page: where it points, its history (every move, break-glass rollbacks flagged
until reviewed), the rollback button and the review button. Changes go through the REST API
from the page's JavaScript (static/ui/alias.js), as on every page."""

from __future__ import annotations

from datetime import timedelta

from django.http import HttpResponse

from registry.access import alias_for, model_for
from registry.services import alias_history, warm_window_s
from rollouts.models import ACTIVE_STATES
from rollouts.rollback import rollback_targets
from tenants.models import Role

from .pages import TenantRequest, page, tenant_view

HISTORY_ROWS = 200  # the newest moves shown; the API lists more


@tenant_view
def alias_detail(request: TenantRequest, name: str, alias: str) -> HttpResponse:
    model = model_for(request.membership.tenant_id, name)
    current = alias_for(model, alias)
    history = list(alias_history(model, alias)[:HISTORY_ROWS])
    targets = rollback_targets(model, current)
    last = history[0] if history else None
    # The default target is the version before the last move, unless that move was itself a
    # rollback (then the API asks for an explicit version; so does the page).
    default = last.from_version if last is not None and not last.break_glass else None
    window = warm_window_s(model)
    warm_until = (
        last.at + timedelta(seconds=window) if last is not None and last.from_version else None
    )
    plan = model.plans.filter(alias=alias, state__in=ACTIVE_STATES).first()
    return page(
        request,
        "alias_history.html",
        {
            "model": model,
            "alias": current,
            "history": history,
            "targets": targets,
            "default_target": default,
            "last_known_good": last.from_version if last is not None else None,
            "warm_until": warm_until,
            "warm_window_s": window,
            "active_plan": plan,
            "is_approver": request.membership.role == Role.APPROVER,
            "user_id": request.user.pk,
        },
    )
