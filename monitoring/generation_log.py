"""The generation log's format and its readers: what generators were asked and answered, a
sample per model (written by ``gateway.genlog``), as Parquet files in the log store's
``generations`` dataset, read with DuckDB for the generations page, its export and the quality
of generators (feedback joined by request id).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from registry.models import Model

from .logstore import log_store, register_dataset, view
from .models import Feedback

GENERATIONS = "generations"

GENERATION_SCHEMA = pa.schema(
    [
        ("tenant_id", pa.int64()),
        ("model_id", pa.int64()),
        ("version_id", pa.int64()),
        ("version", pa.int32()),
        ("arm", pa.string()),
        ("door", pa.string()),
        ("request_id", pa.string()),
        ("trace_id", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("truncated", pa.bool_()),
        ("params", pa.string()),  # JSON: the sampling parameters asked for
        ("input_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("status", pa.int16()),
        ("ttft_ms", pa.float64()),
        ("total_ms", pa.float64()),
        ("tokens_per_second", pa.float64()),
    ]
)

register_dataset(GENERATIONS, GENERATION_SCHEMA)

# What a page shows at most of a prompt or completion in its table (the whole text opens on
# demand); the export carries them whole.
PREVIEW_CHARS = 160
EXPORT_FORMATS = ("jsonl", "csv", "parquet")


@dataclass(frozen=True)
class GenerationFilter:
    """Which logged generations of one model to read."""

    since: datetime
    until: datetime | None = None
    version: int | None = None
    finish_reason: str | None = None
    request_id: str | None = None

    def where(self) -> tuple[str, list[Any]]:
        clauses = ["created_at >= ?"]
        params: list[Any] = [self.since]
        if self.until is not None:
            clauses.append("created_at < ?")
            params.append(self.until)
        if self.version is not None:
            clauses.append("version = ?")
            params.append(self.version)
        if self.finish_reason:
            clauses.append("finish_reason = ?")
            params.append(self.finish_reason)
        if self.request_id:
            clauses.append("request_id = ?")
            params.append(self.request_id)
        return " AND ".join(clauses), params


def _files(model: Model, where: GenerationFilter) -> list[str]:
    # Partition pruning by path: only this tenant's model, only the hours asked for.
    return log_store().files(GENERATIONS, model.tenant_id, [model.pk], where.since, where.until)


def logged_generations(
    model: Model, where: GenerationFilter, limit: int = 50, offset: int = 0
) -> tuple[list[dict[str, Any]], int]:
    """A page of the model's logged generations, newest first, each with the feedback label
    sent for its request id (None without), and how many match in all."""
    files = _files(model, where)
    if not files:
        return [], 0
    clause, params = where.where()
    store = log_store()
    with store.connect(GENERATIONS, files) as con:
        total = con.sql(f"SELECT count(*) FROM log WHERE {clause}", params=params).fetchall()
        page = con.sql(
            f"SELECT * EXCLUDE (tenant_id, model_id) FROM log WHERE {clause} "
            "ORDER BY created_at DESC, request_id LIMIT ? OFFSET ?",
            params=[*params, limit, offset],
        ).to_arrow_table()
    rows = page.to_pylist()
    labels = dict(
        Feedback.objects.filter(
            tenant_id=model.tenant_id, request_id__in=[r["request_id"] for r in rows]
        ).values_list("request_id", "label")
    )
    for row in rows:
        row["label"] = labels.get(row["request_id"])
        row["params"] = orjson.loads(row["params"]) if row["params"] else {}
    return rows, int(total[0][0])


def generation_summary(model: Model, where: GenerationFilter) -> list[dict[str, Any]]:
    """Per version and arm over the window: generations logged, errors, mean tokens in and out,
    TTFT's median and 95th percentile, decoding speed's median, the finish reasons, and the
    feedback joined by request id (how many have a label, the labels' mean: a thumbs-up share
    when labels are 0/1)."""
    files = _files(model, where)
    if not files:
        return []
    clause, params = where.where()
    labels = _feedback_table(model, where)
    with log_store().connect(GENERATIONS, files) as con:
        view(con, "feedback", labels)
        rows = (
            con.sql(
                f"""
            SELECT version, arm, count(*) AS logged,
                   count(*) FILTER (WHERE status >= 400) AS errors,
                   avg(input_tokens) AS mean_input_tokens,
                   avg(output_tokens) AS mean_output_tokens,
                   quantile_cont(ttft_ms, 0.5) AS ttft_p50_ms,
                   quantile_cont(ttft_ms, 0.95) AS ttft_p95_ms,
                   quantile_cont(tokens_per_second, 0.5) AS tokens_per_second_p50,
                   count(f.label) AS labelled,
                   avg(f.label) AS mean_label
            FROM log LEFT JOIN feedback f USING (request_id)
            WHERE {clause}
            GROUP BY version, arm ORDER BY version, arm
            """,
                params=params,
            )
            .to_arrow_table()
            .to_pylist()
        )
        reasons = con.sql(
            f"SELECT version, arm, finish_reason, count(*) FROM log WHERE {clause} GROUP BY ALL",
            params=params,
        ).fetchall()
    by_key: dict[tuple[int, str], dict[str, int]] = {}
    for version, arm, reason, count in reasons:
        by_key.setdefault((version, arm), {})[reason] = count
    for row in rows:
        row["finish_reasons"] = dict(sorted(by_key.get((row["version"], row["arm"]), {}).items()))
    return rows


def _feedback_table(model: Model, where: GenerationFilter) -> pa.Table:
    """The tenant's labels received since the window opened, as (request_id, label): a
    generation's label is one number (a rating, or 0/1 for thumbs down/up); a list takes its
    mean."""
    ids, values = [], []
    for request_id, label in Feedback.objects.filter(
        tenant_id=model.tenant_id, received_at__gte=where.since
    ).values_list("request_id", "label"):
        numbers = [v for v in (label if isinstance(label, list) else [label]) if v is not None]
        if numbers:
            ids.append(request_id)
            values.append(float(sum(numbers)) / len(numbers))
    return pa.table({"request_id": pa.array(ids, pa.string()), "label": pa.array(values)})


def export_generations(model: Model, where: GenerationFilter, fmt: str) -> bytes:
    """The window's logged generations, oldest first, as JSON lines, CSV or Parquet."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format: use one of {', '.join(EXPORT_FORMATS)}")
    files = _files(model, where)
    clause, params = where.where()
    if files:
        table = log_store().query(
            GENERATIONS,
            files,
            f"SELECT * EXCLUDE (tenant_id, model_id) FROM log WHERE {clause} "
            "ORDER BY created_at, request_id",
            params,
        )
    else:
        table = GENERATION_SCHEMA.empty_table().drop_columns(["tenant_id", "model_id"])
    sink = io.BytesIO()
    if fmt == "parquet":
        pq.write_table(table, sink, compression="zstd")
    elif fmt == "csv":
        pacsv.write_csv(table, sink)
    else:
        for row in table.to_pylist():
            sink.write(orjson.dumps(row, option=orjson.OPT_NAIVE_UTC | orjson.OPT_UTC_Z) + b"\n")
    return sink.getvalue()
