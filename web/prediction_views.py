"""The web UI's prediction log page: a model's logged predictions with their labels, filtered and
paged, and a chart of online quality per version and arm over time."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from urllib.parse import urlencode

from django.core.paginator import Paginator
from django.http import FileResponse, HttpResponse, HttpResponseBadRequest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from monitoring.quality import (
    BUCKETS,
    EXPORT_DEFAULT,
    EXPORT_FORMATS,
    LoggedRequest,
    export_log,
    logged_predictions,
    online_quality,
)
from registry.access import model_for

from .pages import TenantRequest, page, tenant_view

PAGE_SIZE = 50
QUALITY_WINDOW = {"hour": timedelta(hours=48), "day": timedelta(days=30)}
PREVIEW_COLUMNS = 4


def _int_or_none(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None


@tenant_view
def model_predictions(request: TenantRequest, name: str) -> HttpResponse:
    model = model_for(request.membership.tenant_id, name)
    filters = {k: request.GET.get(k, "").strip() for k in ("version", "status", "request_id")}
    # Each row comes with its label (the feedback of the request ids on the page).
    rows = logged_predictions(
        model,
        version=_int_or_none(filters["version"]),
        status=_int_or_none(filters["status"]),
        request_id=filters["request_id"][:128] or None,
    )
    paginator: Paginator[LoggedRequest] = Paginator(rows, PAGE_SIZE)
    rows_page = paginator.get_page(request.GET.get("page"))
    bucket = request.GET.get("bucket", "hour")
    if bucket not in BUCKETS:
        bucket = "hour"
    now = timezone.now()
    since = now - QUALITY_WINDOW[bucket]
    series = online_quality(model.tenant_id, model, since, bucket)
    return page(
        request,
        "predictions.html",
        {
            "model": model,
            "sample_percent": f"{model.log_sample_rate * 100:g}",
            "versions": model.versions.order_by("-version").values_list("version", flat=True),
            "filters": filters,
            "query": urlencode({k: v for k, v in filters.items() if v}),
            "page_obj": rows_page,
            "rows": [display_row(r) for r in rows_page],
            "bucket": bucket,
            "chart": quality_chart(model.task, series, (since, now)),
            "totals": quality_totals(series),
        },
    )


@tenant_view
def export_predictions(request: TenantRequest, name: str) -> HttpResponse:
    """The page's "Download" link: the model's log over a time range (default: the last 24
    hours) as CSV or Parquet."""
    model = model_for(request.membership.tenant_id, name)
    fmt = request.GET.get("format", "csv")
    if fmt not in EXPORT_FORMATS:
        return HttpResponseBadRequest(f"format must be one of {', '.join(EXPORT_FORMATS)}")
    bounds: dict[str, datetime | None] = {}
    for key in ("since", "until"):
        text = request.GET.get(key, "").strip()
        try:
            when = parse_datetime(text) if text else None
        except ValueError:
            when = None
        if text and when is None:
            return HttpResponseBadRequest(f"{key}: not a date and time (ISO 8601)")
        if when is not None and timezone.is_naive(when):
            when = timezone.make_aware(when, UTC)
        bounds[key] = when
    until = bounds["until"] or timezone.now()
    since = bounds["since"] or until - EXPORT_DEFAULT
    if since > until:
        return HttpResponseBadRequest("since must not be after until")
    body = export_log(model, fmt, since, until)
    content_type = "text/csv" if fmt == "csv" else "application/vnd.apache.parquet"
    response = FileResponse(
        body,
        as_attachment=True,
        filename=f"{model.name}-predictions.{fmt}",
        content_type=content_type,
    )
    # A streamed file, not an HttpResponse: tenant_view passes it through untouched.
    return cast(HttpResponse, response)


def display_row(row: LoggedRequest) -> dict[str, Any]:
    """A log row as the table shows it: the first few input columns, scores and label."""
    columns = list(row.inputs.items())
    preview = ", ".join(f"{k}={_first(v)}" for k, v in columns[:PREVIEW_COLUMNS])
    if len(columns) > PREVIEW_COLUMNS:
        preview += f", … ({len(columns)} columns)"
    rows = len(row.scores) or max((len(v) for _, v in columns if isinstance(v, list)), default=0)
    return {
        "log": row,
        "rows": rows,
        "inputs": preview,
        "inputs_json": json.dumps(row.inputs)[:4000],
        "scores": ", ".join("–" if s is None else f"{s:.3g}" for s in row.scores[:5])
        + (" …" if len(row.scores) > 5 else ""),
        "label": None if row.label is None else json.dumps(row.label)[:200],
    }


def _first(values: list[Any] | dict[str, Any]) -> str:
    if isinstance(values, dict):  # a high-rank input logged by its shape only
        return f"shape {values.get('shape')}"
    if not values:
        return "[]"
    first = values[0]
    text = f"{first:.4g}" if isinstance(first, float) else str(first)
    return text[:24] + (" …" if len(values) > 1 else "")


METRICS = {"classifier": ("accuracy", "auc"), "regressor": ("mae",)}


def quality_chart(
    task: str, series: list[dict[str, Any]], window: tuple[datetime, datetime]
) -> dict[str, Any]:
    """Plotly-ready lines: one per version and arm, with the metric per bucket, and the time
    axis's range: the whole window, so one bucket is a point on a readable axis (left to
    itself, Plotly spreads one date over a millisecond and labels its ticks in microseconds)."""
    lines: dict[str, dict[str, Any]] = {}
    metrics = METRICS.get(task, ())
    for point in series:
        name = f"v{point['version']}" + (f" · {point['arm']}" if point["arm"] else "")
        line = lines.setdefault(
            name, {"name": name, "t": [], "labelled_rows": [], **{m: [] for m in metrics}}
        )
        line["t"].append(point["bucket_start"].isoformat())
        line["labelled_rows"].append(point["labelled_rows"])
        for metric in metrics:
            line[metric].append(point.get(metric))
    return {
        "task": task,
        "metrics": list(metrics),
        "lines": list(lines.values()),
        "range": [window[0].isoformat(), window[1].isoformat()],
    }


def quality_totals(series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logged and labelled counts per version and arm over the chart's window."""
    counts = ("logged", "labelled", "labelled_rows")
    totals: dict[tuple[int, str], dict[str, Any]] = {}
    for point in series:
        key = (point["version"], point["arm"])
        total = totals.setdefault(
            key, {"version": key[0], "arm": key[1], **dict.fromkeys(counts, 0)}
        )
        for count in counts:
            total[count] += point[count]
    return sorted(totals.values(), key=lambda t: (t["version"], t["arm"]))
