"""The generation log: a sample of text generations, recorded off the request path.

A sampled ``Generation`` (``gateway.generation``; both generation doors go through it) keeps
the text it relays and, when it closes, hands a ``GenerationSample`` to the gateway's
``GenerationLogger``: what was asked (the prompt and the sampling parameters), what was answered
(the completion), token counts, the finish reason, time to first token and the whole stream's
time. The same per-field rules as predictions protect personal data: a version's
``personal_fields`` may name ``prompt`` (its input) and ``text`` (its output, the completion)
as ``redact`` or ``hash``; the rule is applied when the record is built, before anything is
written. Records go to the ``generations`` dataset of the log store (``monitoring.logstore``),
read back by ``monitoring.generation_log`` for the generations page, its export and quality.

Sampling follows the model's ``log_sample_rate``, decided when the stream starts, so an
unsampled stream keeps no text. Usage and billing never read this log: they count every stream
(``Traffic.tokens``, the tenant's budgets), not a sample.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

import orjson
import pyarrow as pa

from monitoring.generation_log import GENERATION_SCHEMA, GENERATIONS
from monitoring.logstore import log_store

from .metrics import GENLOG_RECORDS, GENLOG_RETRIES
from .predlog import REDACTED, Counters, Pending, PredictionLogger, keyed_hash
from .routes import Route

# A completion longer than this is logged cut, and marked so: the log is for reading and
# judging answers, and one runaway stream must not hold megabytes in the writer's buffer.
MAX_LOGGED_CHARS = 32_768
PROMPT_FIELD, COMPLETION_FIELD = "prompt", "text"  # the generators' signature names


class GenerationSample(NamedTuple):
    """A finished (or failed, or cancelled) sampled generation, as the stream left it."""

    route: Route
    arm: str | None
    door: str  # "websocket", "openai.completions" or "openai.chat"
    request_id: str
    trace_id: str
    prompt: str
    completion: str
    params: dict[str, Any]  # the sampling parameters the client asked for
    input_tokens: int
    output_tokens: int
    finish_reason: str  # the agent's, or "cancelled" (the client left) or "error"
    status: int
    ttft_ms: float | None
    total_ms: float
    at: float  # time.time() when the stream ended


def clip(text: str) -> tuple[str, bool]:
    """The text as logged, and whether it was cut."""
    if len(text) <= MAX_LOGGED_CHARS:
        return text, False
    return text[:MAX_LOGGED_CHARS], True


def protect(text: str, rule: str | None, hash_key: bytes) -> str:
    """A text under its field's personal-data rule: as it is, redacted, or its keyed hash
    (equal texts hash equal, so repeated prompts can still be counted and joined)."""
    if rule == "redact":
        return REDACTED
    if rule == "hash":
        return keyed_hash(text, hash_key)
    return text


def generation_table(samples: Sequence[GenerationSample], hash_key: bytes) -> pa.Table:
    """The log rows of some samples, personal fields protected, in the dataset's schema."""
    columns: dict[str, list[Any]] = {name: [] for name in GENERATION_SCHEMA.names}
    for s in samples:
        rules = dict(s.route.personal_fields)
        prompt, prompt_cut = clip(s.prompt)
        completion, completion_cut = clip(s.completion)
        decode_s = (s.total_ms - (s.ttft_ms or 0.0)) / 1000
        row = {
            "tenant_id": s.route.tenant_id,
            "model_id": s.route.model_id,
            "version_id": s.route.version_id,
            "version": s.route.version,
            "arm": s.arm or "",
            "door": s.door,
            "request_id": s.request_id[:128],
            "trace_id": s.trace_id[:32],
            "created_at": datetime.fromtimestamp(s.at, UTC),
            "prompt": protect(prompt, rules.get(PROMPT_FIELD), hash_key),
            "completion": protect(completion, rules.get(COMPLETION_FIELD), hash_key),
            "truncated": prompt_cut or completion_cut,
            "params": orjson.dumps(s.params).decode(),
            "input_tokens": s.input_tokens,
            "output_tokens": s.output_tokens,
            "finish_reason": s.finish_reason,
            "status": s.status,
            "ttft_ms": s.ttft_ms,
            "total_ms": s.total_ms,
            "tokens_per_second": (
                (s.output_tokens - 1) / decode_s if s.output_tokens > 1 and decode_s > 0 else None
            ),
        }
        for name, value in row.items():
            columns[name].append(value)
    return pa.table(columns, schema=GENERATION_SCHEMA)


def sample_of(
    route: Route,
    *,
    arm: str | None,
    door: str,
    request_id: str,
    trace_id: str,
    prompt: str,
    completion: str,
    params: dict[str, Any],
    input_tokens: int,
    output_tokens: int,
    finish_reason: str,
    status: int,
    ttft_ms: float | None,
    total_ms: float,
) -> GenerationSample:
    return GenerationSample(
        route,
        arm,
        door,
        request_id,
        trace_id,
        prompt,
        completion,
        params,
        input_tokens,
        output_tokens,
        finish_reason,
        status,
        ttft_ms,
        total_ms,
        time.time(),
    )


class GenerationLogger(PredictionLogger):
    """One per gateway process: the prediction log's writer (a bounded buffer, a daemon thread
    writing batches as Parquet files, kept and retried while the storage stalls) for the
    ``generations`` dataset. Sampling is the ``Generation``'s, decided when its stream starts."""

    thread_name = "generation-log"
    what = "generation log"
    counters = Counters.of(GENLOG_RECORDS, GENLOG_RETRIES)

    def offer_generation(self, sample: GenerationSample) -> bool:
        """Buffer a sampled generation; True if it went in. Never blocks."""
        return not self._full() and self._append(sample)

    def _build(self, batch: list[Any]) -> Pending:
        store = log_store()
        table = generation_table(batch, self.hash_key)
        return Pending(len(batch), store, store.split(GENERATIONS, table))
