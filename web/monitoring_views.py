"""The web UI's monitoring pages: a model's drift (PSI over time, reference against current
histograms, data quality, latency and errors per version and arm), the tenant's SLOs with their
error budgets and burn rates, and the alerts. Each page's data comes from one snapshot function
that renders the first paint and answers the page's JSON poll, so both always agree."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db.models import Sum
from django.db.models.fields.json import KeyTransform
from django.db.models.functions import TruncMinute
from django.http import HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.utils import timezone

from monitoring.drift import has_logs, set_reference_window
from monitoring.models import Alert, DriftReport, TrafficSample
from monitoring.slo import bucket_count, burn_series, model_slos
from monitoring.traffic import N_BUCKETS, ArmStats
from registry.access import model_for, models_of
from registry.models import Model, ModelVersion, ReferenceSample
from rollouts.arms import plan_arms
from rollouts.models import ACTIVE_STATES
from tenants.audit import user_actor
from tenants.members import can_write

from .pages import TenantRequest, page, tenant_view
from .selfservice import error_messages, reference_window, writer_view

DRIFT_CHART = timedelta(hours=24)
TRAFFIC_CHART = timedelta(hours=3)
RESOLVED_SHOWN = 50
SCORE = "score"  # the report's entry on the output scores, next to the features


# Drift ---------------------------------------------------------------------------------------


def version_number(text: str | None) -> int | None:
    """A version number from a query or form field; None for anything else, including digits
    ``int()`` refuses ("²") and numbers past any integer column (a database error otherwise)."""
    text = (text or "").strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else None


def chosen_version(model: Model, number: str | None) -> ModelVersion | None:
    """The version asked for, else the one ``production`` points at, else the newest."""
    versions = model.versions.all()
    wanted = version_number(number)
    if wanted is not None:
        found = versions.filter(version=wanted).first()
        if found is not None:
            return found
    alias = model.aliases.filter(name="production").select_related("version").first()
    return alias.version if alias else versions.order_by("-version").first()


def psi_series(version: ModelVersion, names: list[str], since: datetime) -> dict[str, Any]:
    """Each named feature's PSI (and the scores') per report since ``since``, read out of the
    reports' JSON by the database: a day of reports with their histograms is megabytes."""
    fields = {
        f"f{i}": KeyTransform("psi", KeyTransform(n, "features")) for i, n in enumerate(names)
    }
    rows = (
        DriftReport.objects.filter(version=version, created_at__gte=since)
        .order_by("created_at")
        .annotate(score_psi=KeyTransform("psi", "score"), **fields)
        .values_list("created_at", "threshold", "score_psi", *fields)
    )
    series: dict[str, Any] = {
        "t": [],
        "threshold": [],
        SCORE: [],
        "features": {n: [] for n in names},
    }
    for at, threshold, score, *values in rows:
        series["t"].append(at.isoformat())
        series["threshold"].append(threshold)
        series[SCORE].append(score)
        for name, value in zip(names, values, strict=True):
            series["features"][name].append(value)
    return series


def bin_labels(entry: dict[str, Any]) -> list[str]:
    """Readable bins of a report's histogram: categories as they are; numeric bins from the
    reference's edges, the outer two open-ended (as ``monitoring.drift.bin_shares`` fills them)."""
    if entry.get("categories") is not None:
        return list(entry["categories"])
    edges = entry.get("edges") or []
    inner = [f"{x:.3g}" for x in edges[1:-1]]
    if not inner:
        return ["all"]
    return (
        [f"< {inner[0]}"]
        + [f"{lo} – {hi}" for lo, hi in zip(inner, inner[1:], strict=False)]
        + [f"≥ {inner[-1]}"]
    )


def histogram(report: DriftReport, feature: str | None) -> dict[str, Any] | None:
    """Reference against current shares of one feature of a report (default: the most
    drifted), with the names a select offers."""
    entries = {**report.features, **({SCORE: report.score} if report.score else {})}
    measured = {n: e for n, e in entries.items() if e.get("psi") is not None}
    if not measured:
        return None
    if feature not in measured:
        feature = max(measured, key=lambda n: measured[n]["psi"])
    entry = measured[feature]
    return {
        "feature": feature,
        "kind": entry["kind"],
        "psi": entry["psi"],
        "flagged": entry["flagged"],
        "bins": bin_labels(entry),
        "reference": entry["reference"],
        "current": entry["current"],
        "choices": sorted(measured, key=lambda n: -measured[n]["psi"]),
    }


def feature_rows(report: DriftReport) -> list[dict[str, Any]]:
    """The latest report as a table: distances and data-quality counts per feature, worst
    first; a feature only in the quality counts (one the reference lacks) too."""
    entries = {**report.features, **({SCORE: report.score} if report.score else {})}
    names = list(dict.fromkeys([*entries, *report.quality]))
    rows = []
    for name in names:
        entry = entries.get(name, {})
        quality = report.quality.get(name, {})
        rows.append(
            {
                "feature": name,
                "kind": entry.get("kind", "not in the reference"),
                "psi": entry.get("psi"),
                "ks": entry.get("ks"),
                "distance": entry.get("distance"),
                "flagged": name in report.flagged,
                "values": entry.get("values"),
                "nulls": quality.get("nulls", 0),
                "out_of_range": quality.get("out_of_range", 0),
                "schema": quality.get("schema", 0),
            }
        )
    return sorted(rows, key=lambda r: -(r["psi"] if r["psi"] is not None else -1))


def arm_names(model: Model) -> dict[int, str]:
    """{version id: arm} from the model's active plan, else its last one."""
    plans = model.plans.prefetch_related("arms").select_related("baseline", "candidate")
    plan = plans.filter(state__in=ACTIVE_STATES).first() or plans.first()
    if plan is None:
        return {}
    return {vid: name for name, vid, _ in plan_arms(plan)}


def traffic_series(model: Model, since: datetime) -> dict[str, list[dict[str, Any]]]:
    """Per version (named with its arm), one point per minute with traffic: requests,
    error rate and p50/p95/p99 (None above the histogram's last bound)."""
    buckets = {f"b{i}": Sum(bucket_count(i)) for i in range(N_BUCKETS)}
    rows = (
        TrafficSample.objects.filter(version__model=model, window_end__gte=since)
        .annotate(minute=TruncMinute("window_end"))
        .values("version__version", "version_id", "minute")
        .annotate(requests=Sum("requests"), errors=Sum("errors"), **buckets)
        .order_by("version__version", "minute")
    )
    arms = arm_names(model)
    series: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        arm = arms.get(row["version_id"])
        label = f"v{row['version__version']}" + (f" · {arm}" if arm else "")
        stats = ArmStats(
            row["requests"], row["errors"], tuple(row[f"b{i}"] or 0 for i in range(N_BUCKETS))
        )
        numbers = stats.as_dict()
        series.setdefault(label, []).append(
            {
                "t": (row["minute"] + timedelta(minutes=1)).isoformat(),
                "requests": stats.requests,
                "error_rate": numbers["error_rate"],
                "p50_ms": numbers["p50_ms"],
                "p95_ms": numbers["p95_ms"],
                "p99_ms": numbers["p99_ms"],
            }
        )
    return series


def drift_empty_state(
    model: Model,
    version: ModelVersion | None,
    reference: Mapping[str, Any] | None,
    reports: bool,
) -> str | None:
    """What the page says instead of drift charts, naming what to do next; None when there
    are reports to show."""
    if version is None:
        return "This model has no version yet: upload one first."
    if reports:
        return None
    url = f"/api/v1/models/{model.name}/versions/{version.version}/reference"
    if reference is None:
        return (
            f"No reference sample uploaded yet for v{version.version}: PUT one (rows or columns "
            f"of features, with scores) to {url}, or POST a past window of its logged "
            "predictions there. Drift is measured against it."
        )
    if not has_logs(version):
        return (
            f"No logged predictions for v{version.version} yet: the gateway logs "
            f"{model.log_sample_rate * 100:g} % of its predictions. Send it traffic."
        )
    return (
        f"No drift report yet: every minute the drift job compares the last "
        f"{model.drift_window_minutes} min of logged predictions with the reference, once both "
        "hold at least 30 rows."
    )


def drift_snapshot(model: Model, version_number: str | None, feature: str | None) -> dict[str, Any]:
    """Everything the drift page draws, for one version of the model."""
    now = timezone.now()
    version = chosen_version(model, version_number)
    versions = list(model.versions.order_by("-version").values_list("version", flat=True))
    snapshot: dict[str, Any] = {
        "model": model.name,
        "version": version.version if version else None,
        "versions": versions,
        "threshold": model.drift_threshold,
        "traffic": traffic_series(model, now - TRAFFIC_CHART),
        "reference": None,
        "latest": None,
        "psi": None,
        "histogram": None,
    }
    reference = None
    latest = None
    if version is not None:
        reference = (
            ReferenceSample.objects.filter(version=version)
            .values("source", "rows", "created_at")
            .first()
        )
        latest = DriftReport.objects.filter(version=version).order_by("-created_at").first()
    snapshot["empty"] = drift_empty_state(model, version, reference, latest is not None)
    if reference is not None:
        snapshot["reference"] = reference | {"created_at": reference["created_at"].isoformat()}
    if latest is not None:
        rows = feature_rows(latest)
        snapshot["latest"] = {
            "at": latest.created_at.isoformat(),
            "window_start": latest.window_start.isoformat(),
            "window_end": latest.window_end.isoformat(),
            "rows_current": latest.rows_current,
            "rows_reference": latest.rows_reference,
            "reference_source": latest.reference_source,
            "threshold": latest.threshold,
            "flagged": latest.flagged,
            "max_psi": latest.max_psi,
            "features": rows,
        }
        names = [r["feature"] for r in rows if r["feature"] in latest.features]
        assert version is not None  # latest is a report of this version
        snapshot["psi"] = psi_series(version, names, now - DRIFT_CHART)
        snapshot["histogram"] = histogram(latest, feature)
    return snapshot


def _model(request: TenantRequest, name: str) -> Model:
    return model_for(request.membership.tenant_id, name)


@tenant_view
def drift(request: TenantRequest, name: str) -> HttpResponse:
    model = _model(request, name)
    snapshot = drift_snapshot(model, request.GET.get("version"), request.GET.get("feature"))
    return page(request, "drift.html", {"model": model, "snapshot": snapshot})


@tenant_view
def drift_data(request: TenantRequest, name: str) -> JsonResponse:
    model = _model(request, name)
    return JsonResponse(
        drift_snapshot(model, request.GET.get("version"), request.GET.get("feature"))
    )


@writer_view
def set_drift_reference(request: TenantRequest, name: str) -> HttpResponse:
    """The drift page's "Set drift reference" form: a past window of a version's logged
    predictions becomes its reference (``monitoring.drift.set_reference_window``, audited)."""
    model = model_for(request.membership.tenant_id, name)
    post = {k: request.POST.get(k, "") for k in ("version", "mode", "hours")}
    post |= {k: request.POST.get(k, "") for k in ("window_start", "window_end")}
    number = version_number(post["version"])
    version = None if number is None else model.versions.filter(version=number).first()
    errors: dict[str, str] = {}
    if version is None:
        errors = {"version": "choose a version of this model"}
    else:
        try:
            start, end = reference_window(post, timezone.now())
            actor = user_actor(request.user, request.membership.role)
            sample = set_reference_window(version, start, end, actor)
        except ValidationError as exc:
            errors = error_messages(exc.message_dict)
        else:
            return redirect(
                f"/models/{model.name}/drift/?version={version.version}&reference={sample.rows}"
            )
    snapshot = drift_snapshot(model, post["version"], None)
    return page(
        request,
        "drift.html",
        {
            "model": model,
            "snapshot": snapshot,
            "reference_form": {"values": post, "errors": errors},
        },
        status=400,
    )


# SLOs ----------------------------------------------------------------------------------------


def slo_snapshot(tenant_id: int) -> dict[str, Any]:
    """Every model of the tenant: both SLIs with budget and burn rates, and the burn chart."""
    now = timezone.now()
    return {
        "window_days": settings.SWITCHYARD_SLO_WINDOW_DAYS,
        "models": [
            model_slos(model, now) | {"series": burn_series(model, now)}
            for model in models_of(tenant_id).order_by("name")
        ],
    }


@tenant_view
def slo(request: TenantRequest) -> HttpResponse:
    return page(request, "slo.html", {"snapshot": slo_snapshot(request.membership.tenant_id)})


@tenant_view
def slo_data(request: TenantRequest) -> JsonResponse:
    return JsonResponse(slo_snapshot(request.membership.tenant_id))


# Alerts --------------------------------------------------------------------------------------


@tenant_view
def alerts(request: TenantRequest) -> HttpResponse:
    tenant = request.membership.tenant
    rows = Alert.objects.filter(tenant=tenant).select_related("model")
    writer = can_write(request.membership)
    return page(
        request,
        "alerts.html",
        {
            "open": rows.filter(resolved_at=None),
            "resolved": rows.exclude(resolved_at=None).order_by("-resolved_at")[:RESOLVED_SHOWN],
            # The webhook URL is a credential: only those who may change it see it.
            "webhook_url": tenant.alert_webhook_url if writer else None,
        },
    )
