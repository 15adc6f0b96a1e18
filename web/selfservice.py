"""What the web UI's self-service forms share: an engineer (or approver) registers a model
(``web.views.create_model``) and sets a version's drift reference
(``web.monitoring_views.set_drift_reference``) without the Django admin. Each form is validated
like the REST API's request and calls the same audited domain function; errors come back inline,
with the page re-rendered and a 400. Viewers see no forms, and a viewer's POST is a 403.

(A version upload needs no view: the model page's script sends the file straight to the REST
endpoint, ``POST /api/v1/models/{name}/versions``, to show upload progress.)"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import wraps
from typing import Any

from django.core.exceptions import ValidationError
from django.http import HttpResponse
from django.views.decorators.http import require_POST

from registry.models import TaskKind
from tenants.members import can_write

from .pages import TenantRequest, tenant_view

MAX_REFERENCE_HOURS = 24 * 90  # the prediction log's longest retention, roughly


def writer_view(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """POST only, and only for roles that may change things: a viewer gets a 403 page."""

    @tenant_view
    @require_POST
    @wraps(view)
    def wrapper(request: TenantRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not can_write(request.membership):
            return HttpResponse("Viewers cannot change anything in this tenant.", status=403)
        return view(request, *args, **kwargs)

    return wrapper


def error_messages(errors: Any) -> dict[str, str]:
    """{field: one readable line} from DRF's or Django's error dicts."""
    return {
        field: " ".join(str(m) for m in (msgs if isinstance(msgs, list) else [msgs]))
        for field, msgs in dict(errors).items()
    }


def model_form_context(values: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "model_form": {"values": values or {"task": TaskKind.CLASSIFIER}, "errors": {}},
        "tasks": TaskKind.values,
    }


def reference_window(post: dict[str, str], now: datetime) -> tuple[datetime, datetime]:
    """The window a drift-reference form names: the last N hours, or a start and an end
    (``datetime-local`` values, read as UTC like every time the UI shows)."""
    if post.get("mode", "hours") == "hours":
        text = post.get("hours", "").strip()
        try:
            hours = float(text)
        except ValueError:
            raise ValidationError({"hours": "a number of hours, e.g. 24"}) from None
        if not 0 < hours <= MAX_REFERENCE_HOURS:
            raise ValidationError({"hours": f"between 0 and {MAX_REFERENCE_HOURS} hours"})
        return now - timedelta(hours=hours), now
    bounds = []
    for field in ("window_start", "window_end"):
        try:
            at = datetime.fromisoformat(post.get(field, "").strip())
        except ValueError:
            raise ValidationError({field: "a time such as 2026-11-26T14:00 (UTC)"}) from None
        bounds.append(at.replace(tzinfo=UTC) if at.tzinfo is None else at)
    return bounds[0], bounds[1]
