"""The web UI's generation log page: what a text generator was asked and answered (a sample),
per version and arm — tokens, time to first token, decoding speed, finish reasons and the
feedback joined by request id — and the log itself, filtered, paged and exportable."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.http import Http404, HttpResponse
from django.utils import timezone

from monitoring.generation_log import (
    EXPORT_FORMATS,
    PREVIEW_CHARS,
    GenerationFilter,
    export_generations,
    generation_summary,
    logged_generations,
)
from registry.access import model_for
from registry.models import TaskKind

from .pages import TenantRequest, page, tenant_view

PAGE_SIZE = 50
WINDOWS = {"1h": timedelta(hours=1), "24h": timedelta(hours=24), "7d": timedelta(days=7)}
EXPORT_CONTENT_TYPES = {
    "jsonl": "application/x-ndjson",
    "csv": "text/csv",
    "parquet": "application/vnd.apache.parquet",
}


def _filter(request: TenantRequest) -> tuple[GenerationFilter, dict[str, str]]:
    raw = {k: request.GET.get(k, "").strip() for k in ("window", "version", "finish", "request")}
    if raw["window"] not in WINDOWS:
        raw["window"] = "24h"
    version = raw["version"]
    where = GenerationFilter(
        since=timezone.now() - WINDOWS[raw["window"]],
        version=int(version) if version.isdigit() and len(version) < 10 else None,
        finish_reason=raw["finish"][:32] or None,
        request_id=raw["request"][:128] or None,
    )
    return where, raw


def _page_number(text: str) -> int:
    return int(text) if text.isdigit() and len(text) < 7 and int(text) > 0 else 1


@tenant_view
def model_generations(request: TenantRequest, name: str) -> HttpResponse:
    model = model_for(request.membership.tenant_id, name)
    if model.task != TaskKind.GENERATOR:
        raise Http404("only text generators log generations")
    where, raw = _filter(request)
    number = _page_number(request.GET.get("page", ""))
    rows, total = logged_generations(model, where, PAGE_SIZE, (number - 1) * PAGE_SIZE)
    query = urlencode({k: v for k, v in raw.items() if v})
    return page(
        request,
        "generations.html",
        {
            "model": model,
            "sample_percent": f"{model.log_sample_rate * 100:g}",
            "versions": model.versions.order_by("-version").values_list("version", flat=True),
            "filters": raw,
            "windows": list(WINDOWS),
            "query": query,
            "summary": generation_summary(model, where),
            "rows": [display_row(r) for r in rows],
            "total": total,
            "page": number,
            "pages": max(1, -(-total // PAGE_SIZE)),
            "formats": EXPORT_FORMATS,
        },
    )


def display_row(row: dict[str, Any]) -> dict[str, Any]:
    """A logged generation as the table shows it: prompt and completion cut to a preview
    (the whole text in the row's details)."""
    at: datetime = row["created_at"]
    return {
        **row,
        "at": at,
        "prompt_preview": _preview(row["prompt"]),
        "completion_preview": _preview(row["completion"]),
        "label": None if row["label"] is None else str(row["label"])[:200],
    }


def _preview(text: str) -> str:
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + " …"


@tenant_view
def export(request: TenantRequest, name: str) -> HttpResponse:
    """The page's window and filters, every matching generation, as a download."""
    model = model_for(request.membership.tenant_id, name)
    if model.task != TaskKind.GENERATOR:
        raise Http404("only text generators log generations")
    fmt = request.GET.get("format", "jsonl")
    if fmt not in EXPORT_FORMATS:
        return HttpResponse(f"format: use one of {', '.join(EXPORT_FORMATS)}", status=400)
    where, raw = _filter(request)
    response = HttpResponse(
        export_generations(model, where, fmt), content_type=EXPORT_CONTENT_TYPES[fmt]
    )
    response["Content-Disposition"] = (
        f'attachment; filename="{model.name}-generations-{raw["window"]}.{fmt}"'
    )
    return response
