"""The web UI's pages. Views only pick the tenant, look up through it and render; every change
goes through the REST API from the page's JavaScript, so the UI has no second write path."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.utils.dateparse import parse_date
from django.views.decorators.http import require_POST

from registry import services
from registry.access import model_for, models_of
from registry.api.serializers import ModelSerializer
from registry.formats import DEFAULT_FORMAT, FORMATS
from registry.models import TaskKind
from rollouts.access import approval_for, approvals_of, plan_for
from rollouts.approvals import evidence_of
from rollouts.models import PlanMode, RequestState
from rollouts.policy import freeze_status
from tenants.audit import audit_events, user_actor
from tenants.members import SESSION_KEY, memberships_of
from tenants.models import AuditEvent, Role

from .pages import TenantRequest, page, tenant_view
from .selfservice import error_messages, model_form_context, writer_view
from .snapshots import dashboard_snapshot, fleet_snapshot, plan_snapshot

AUDIT_PAGE_SIZE = 50
LIST_PAGES = ("/", "/fleet/", "/approvals/", "/audit/", "/slo/", "/alerts/")


@tenant_view
def home(request: TenantRequest) -> HttpResponse:
    context = {"snapshot": dashboard_snapshot(_tenant_id(request))} | model_form_context()
    return page(request, "home.html", context)


MODEL_FIELDS = ("name", "task", "description")


@writer_view
def create_model(request: TenantRequest) -> HttpResponse:
    """The home page's "New model" form: ``ModelSerializer`` validates it (as the API does),
    ``registry.services.create_model`` stores and audits it."""
    values = {f: request.POST.get(f, "").strip() for f in MODEL_FIELDS}
    serializer = ModelSerializer(data=values)
    errors: dict[str, str] = {}
    if not serializer.is_valid():
        errors = error_messages(serializer.errors)
    else:
        data = dict(serializer.validated_data)
        try:
            model = services.create_model(
                request.membership.tenant_id,
                user_actor(request.user, request.membership.role),
                data.pop("name"),
                data.pop("task"),
                **data,
            )
        except services.DuplicateName as exc:
            errors = {exc.field: str(exc)}
        except ValidationError as exc:
            errors = error_messages(exc.message_dict)
        else:
            return redirect("model", model.name)
    context = model_form_context(values)
    context["model_form"]["errors"] = errors
    context["snapshot"] = dashboard_snapshot(request.membership.tenant_id)
    return page(request, "home.html", context, status=400)


@tenant_view
def model_detail(request: TenantRequest, name: str) -> HttpResponse:
    model = model_for(_tenant_id(request), name)
    versions = model.versions.select_related("parent").order_by("-version")
    aliases = model.aliases.select_related("version").order_by("name")
    production = next((a for a in aliases if a.name == "production"), None)
    plans = model.plans.select_related("baseline", "candidate")
    active = next((p for p in plans if p.is_active), None)
    # The upload form offers every format; a generator's first choice is one that generates text.
    generating = [f.value for f in FORMATS.values() if f.generates_text]
    upload_format = generating[0] if model.task == TaskKind.GENERATOR else DEFAULT_FORMAT
    return page(
        request,
        "model.html",
        {
            "model": model,
            "formats": FORMATS.values(),
            "upload_format": upload_format,
            "versions": versions,
            "aliases": aliases,
            "plans": plans,
            "active_plan": active,
            # A canary moves production from the version it points at towards another one.
            "candidates": [v for v in versions if production and v.pk != production.version_id],
            # A spent error budget freezes starts, steps and promotions: shown where they are.
            "freeze": freeze_status(model),
            "is_approver": request.membership.role == Role.APPROVER,
        },
    )


@tenant_view
def playground(request: TenantRequest, name: str) -> HttpResponse:
    """Type a prompt, watch the tokens stream over the generation websocket (signed in with
    the session), see time to first token and tokens per second."""
    model = model_for(_tenant_id(request), name)
    production = model.aliases.select_related("version").filter(name="production").first()
    version = production.version if production else None
    return page(
        request,
        "playground.html",
        {"model": model, "version": version, "generates": bool(version and version.generates_text)},
    )


@tenant_view
def rollout_detail(request: TenantRequest, plan_id: int) -> HttpResponse:
    plan = plan_for(_tenant_id(request), plan_id)
    return page(
        request,
        "rollout.html",
        {
            "plan": plan,
            "is_canary": plan.mode == PlanMode.CANARY,
            "snapshot": plan_snapshot(plan),
            "freeze": freeze_status(plan.model) if plan.is_active else None,
        },
    )


@tenant_view
def fleet(request: TenantRequest) -> HttpResponse:
    """Deployments with their replicas and the autoscaler's decisions, and the live agents.
    The page's script fetches it again every few seconds and swaps the changed parts in."""
    return page(request, "fleet.html", {"fleet": fleet_snapshot(_tenant_id(request))})


@tenant_view
def approvals(request: TenantRequest) -> HttpResponse:
    rows = approvals_of(_tenant_id(request))
    return page(
        request,
        "approvals.html",
        {
            "pending": rows.filter(state=RequestState.PENDING),
            "decided": rows.exclude(state=RequestState.PENDING)[:25],
        },
    )


@tenant_view
def approval_detail(request: TenantRequest, approval_id: int) -> HttpResponse:
    approval = approval_for(_tenant_id(request), approval_id)
    own = approval.requested_by_id == request.user.pk
    return page(
        request,
        "approval.html",
        {
            "approval": approval,
            "evidence": evidence_display(evidence_of(approval)),
            "own_request": own,
            "may_decide": approval.state == RequestState.PENDING
            and request.membership.role == Role.APPROVER
            and not own,
        },
    )


@tenant_view
def audit(request: TenantRequest) -> HttpResponse:
    filters = {k: request.GET.get(k, "").strip() for k in ("action", "actor", "q", "from", "to")}
    where: dict[str, Any] = {k: filters[k] for k in ("action", "actor", "q")}
    errors = {}
    for field, key, days in (("from", "since", 0), ("to", "until", 1)):
        if filters[field]:
            day = _day(filters[field])
            if day is None:
                errors[field] = "a date, YYYY-MM-DD"
                continue
            # Days in UTC, the "to" day included: events before the next midnight.
            start = datetime(day.year, day.month, day.day, tzinfo=UTC)
            where[key] = start + timedelta(days=days)
    events = audit_events(_tenant_id(request), where)
    events_page = Paginator(events, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    actions = AuditEvent.objects.filter(tenant_id=_tenant_id(request)).values_list("action")
    links = audit_links(_tenant_id(request), list(events_page))
    return page(
        request,
        "audit.html",
        {
            "page_obj": events_page,
            "rows": [(e, changes(e.before, e.after), links.get(e.pk)) for e in events_page],
            "filters": filters,
            "errors": errors,
            "query": urlencode({k: v for k, v in filters.items() if v}),
            "actions": actions.order_by("action").distinct().values_list("action", flat=True),
        },
        status=400 if errors else 200,
    )


def _day(text: str) -> date | None:
    try:
        return parse_date(text)
    except ValueError:  # well formed, no such day (2026-02-30)
        return None


# "#12 promotion acme/clf@production → v2 (pending)", "acme/clf@production: canary v1→v2",
# "acme/clf v3": the request and the model (and alias) an event's target names.
_REQUEST_TARGET = re.compile(r"^#(\d+) ")
_MODEL_TARGET = re.compile(r"^(?:#\d+ \w+ )?[^/\s]+/([^@\s]+?)(?:@([^:\s]+))?(?:[:\s]|$)")


def audit_links(tenant_id: int, events: list[AuditEvent]) -> dict[int, str]:
    """A link to the object each event is about, where it still exists: an approval request,
    an alias or a model (one query for the page's models)."""
    found: dict[int, tuple[str, str | None]] = {}
    requests: dict[int, str] = {}
    for event in events:
        if event.action.startswith("approval.") and (m := _REQUEST_TARGET.match(event.target)):
            requests[event.pk] = m.group(1)
        elif m := _MODEL_TARGET.match(event.target):
            found[event.pk] = (m.group(1), m.group(2))
    names = {name for name, _ in found.values()}
    existing = set(models_of(tenant_id).filter(name__in=names).values_list("name", flat=True))
    links = {pk: reverse("approval", args=[int(n)]) for pk, n in requests.items()}
    for pk, (name, alias) in found.items():
        if name in existing:
            links[pk] = (
                reverse("alias", args=[name, alias]) if alias else reverse("model", args=[name])
            )
    return links


@login_required
@require_POST
def switch_tenant(request: HttpRequest) -> HttpResponse:
    """Remember the chosen tenant; only one the user is a member of."""
    slug = request.POST.get("tenant", "")
    chosen = next((m for m in memberships_of(request.user) if m.tenant.slug == slug), None)
    if chosen is not None:
        request.session[SESSION_KEY] = chosen.tenant_id
    back = request.POST.get("next", "/")
    # Pages of the old tenant's objects would 404 in the new one: only the lists are kept.
    return redirect(back if back in LIST_PAGES else "/")


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.2f} %"


def _ms(x: float | None) -> str:
    return "> 10 s" if x is None else f"{x:g} ms"  # None: the histogram's open-ended bucket


def _weight(arm: dict[str, Any]) -> str:
    if arm["arm"] == "shadow":
        return "copy"
    return "–" if arm["weight"] is None else f"{arm['weight']:g} %"  # None: no plan, no split


ARM_FORMATS = {"error_rate": _pct, "p50_ms": _ms, "p95_ms": _ms, "p99_ms": _ms}


def evidence_display(evidence: dict[str, Any]) -> dict[str, Any]:
    """Evidence numbers as an approver reads them: percentages, milliseconds, signed diffs."""
    arms = [
        {
            "arm": arm["arm"],
            "version": arm["version"],
            "weight": _weight(arm),
            "requests": arm["requests"],
            "errors": arm["errors"],
            # Without requests the percentiles are meaningless zeros.
            **{k: fmt(arm[k]) if arm["requests"] else "–" for k, fmt in ARM_FORMATS.items()},
        }
        for arm in evidence.get("arms") or []
    ]
    diff = evidence.get("diff")
    if diff is not None and diff.get("not_enough_data"):
        n = diff["n"]
        diff = {
            "not_enough": f"not enough data: n = {n['candidate']} (candidate), "
            f"{n['baseline']} (baseline); a comparison needs {diff['need']} of each"
        }
    elif diff is not None:
        n = diff.get("n") or {}
        diff = {
            "label": f"candidate − baseline (n = {n.get('candidate', '?')} and "
            f"{n.get('baseline', '?')} requests)",
            "error_rate": f"{diff['error_rate'] * 100:+.2f} pp" if "error_rate" in diff else "–",
            **{k: f"{diff[k]:+g} ms" if k in diff else "–" for k in ("p50_ms", "p95_ms", "p99_ms")},
        }
    shadow = evidence.get("shadow")
    if shadow is not None:
        rate = shadow.get("agreement_rate")
        shadow = (
            "no copies compared yet"
            if rate is None
            else f"{rate * 100:.1f} % of {shadow['answered']} copies agreed "
            f"({shadow['failed']} failed)"
        )
    since = evidence.get("since")
    window = (
        f"since the plan started, {since[:16].replace('T', ' ')} UTC"
        if evidence.get("plan") is not None and since
        else "over the hour before"
    )
    return {
        "arms": arms,
        "diff": diff,
        "window": window,
        "shadow": shadow,
        "drift": evidence.get("drift"),
        "offline": evidence.get("offline_metrics") or {},
    }


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, object, object]]:
    """(key, before, after) for the keys an audit event changed, for a compact display."""
    keys = list(dict.fromkeys([*before, *after]))
    return [(k, before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)]


def _tenant_id(request: TenantRequest) -> int:
    return request.membership.tenant_id
