"""The generation log: sampled generations from both generation doors written as Parquet to the
log store's ``generations`` dataset, personal fields protected as each version says, read back
for the page, the API, the export and the per-version summary with feedback joined; one
tenant's log is never another's."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import time
from datetime import timedelta

import pyarrow.parquet as pq
import pytest
from django.utils import timezone

from gateway.genlog import MAX_LOGGED_CHARS, generation_table, sample_of
from gateway.predlog import REDACTED
from gateway.routes import Route
from monitoring.generation_log import GENERATIONS, GenerationFilter, logged_generations
from monitoring.logstore import log_store
from monitoring.models import Feedback
from monitoring.prediction_log import compact_closed_hours, purge_expired_logs
from tests import test_generation as tg
from tests.factories import make_model
from tests.test_generation import FakeAgent, frames_until_end, openai_post, run, socket

# The generation tests' fixtures: a generator "writer" of tenant a, and the gateway state both
# doors share.
writer, state = tg.writer, tg.state
# The consumers reach the database from worker threads: committed data, real connections.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.backends]

KEY = b"test key"


@pytest.fixture(autouse=True)
def own_log_root(settings, tmp_path):
    settings.SWITCHYARD_LOG_ROOT = str(tmp_path / "logs")


def route(personal: dict | None = None) -> Route:
    return Route(
        tenant_id=1,
        model_name="writer",
        version_id=5,
        model_id=2,
        version=3,
        task="generator",
        inputs=(),
        outputs=(),
        feature_names=(),
        generates_text=True,
        log_sample_rate=1.0,
        personal_fields=tuple(sorted((personal or {}).items())),
    )


def sample(r: Route, prompt: str = "my card is 4242", completion: str = "noted", **kw):
    fields = {
        "arm": None,
        "door": "websocket",
        "request_id": "req-1",
        "trace_id": "ab" * 16,
        "prompt": prompt,
        "completion": completion,
        "params": {"max_tokens": 8, "temperature": 0.5},
        "input_tokens": 15,
        "output_tokens": 5,
        "finish_reason": "stop",
        "status": 200,
        "ttft_ms": 10.0,
        "total_ms": 50.0,
    } | kw
    return sample_of(r, **fields)


def test_prompt_and_completion_follow_the_versions_personal_rules():
    kept = generation_table([sample(route())], KEY).to_pylist()[0]
    assert (kept["prompt"], kept["completion"]) == ("my card is 4242", "noted")
    assert kept["tokens_per_second"] == pytest.approx(4 / 0.040)
    protected = generation_table(
        [sample(route({"prompt": "hash", "text": "redact"}))], KEY
    ).to_pylist()[0]
    assert protected["completion"] == REDACTED
    assert protected["prompt"] == hmac.new(KEY, b"my card is 4242", hashlib.sha256).hexdigest()
    assert "4242" not in json.dumps(protected, default=str)


def test_a_runaway_completion_is_cut_and_marked():
    row = generation_table([sample(route(), completion="x" * (MAX_LOGGED_CHARS + 10))], KEY)
    got = row.to_pylist()[0]
    assert len(got["completion"]) == MAX_LOGGED_CHARS and got["truncated"] is True


def test_both_doors_log_what_was_asked_and_answered(writer, state):
    writer.version.model.log_sample_rate = 1.0
    writer.version.model.save()

    async def scenario():
        FakeAgent(state(), writer.version.pk)
        body = {"model": "writer", "prompt": "hello", "max_tokens": 10, "temperature": 0.3}
        await openai_post(writer.key_a, "/v1/completions", body)()
        chat = {"model": "writer", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
        await openai_post(writer.key_a, "/v1/chat/completions", chat | {"stream": True})()
        async with socket(writer.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g1", "prompt": "call me"})
            await frames_until_end(ws, "g1")
        assert state().genlog.flush(10)

    run(scenario)
    model = writer.version.model
    rows, total = logged_generations(model, GenerationFilter(since=timezone.now() - timedelta(1)))
    assert total == 3
    by_door = {r["door"]: r for r in rows}
    assert set(by_door) == {"openai.completions", "openai.chat", "websocket"}
    completion = by_door["openai.completions"]
    assert (completion["prompt"], completion["completion"]) == ("hello", "HELLO")
    assert completion["params"]["max_tokens"] == 10
    assert completion["params"]["temperature"] == pytest.approx(0.3)
    assert (completion["input_tokens"], completion["output_tokens"]) == (5, 5)
    assert completion["finish_reason"] == "length" and completion["status"] == 200
    assert completion["ttft_ms"] is not None and completion["total_ms"] >= completion["ttft_ms"]
    assert len(completion["request_id"]) == 32 and len(completion["trace_id"]) == 32
    assert "hi" in by_door["openai.chat"]["prompt"]
    assert by_door["websocket"]["completion"] == "CALL ME"
    # Partitioned by tenant and model: the files lie under this tenant's own prefix.
    files = log_store().files(GENERATIONS, model.tenant_id, [model.pk])
    assert files and all(f"/tenant={model.tenant_id}/model={model.pk}/hour=" in f for f in files)
    assert log_store().files(GENERATIONS, writer.b.pk) == []


def test_a_cancelled_stream_is_logged_as_cancelled_with_what_was_sent(writer, state):
    writer.version.model.log_sample_rate = 1.0
    writer.version.model.save()

    async def scenario():
        FakeAgent(state(), writer.version.pk, delay=0.02)
        async with socket(writer.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "x" * 30})
            await ws.receive_json_from(timeout=5)
            await ws.send_json_to({"type": "cancel", "id": "g"})
            await frames_until_end(ws, "g")
        # The client hears "cancelled" before the stream is closed (and logged) behind it.
        for _ in range(100):
            if state().genlog.flush(10) and state().genlog.written:
                break
            await asyncio.sleep(0.02)

    run(scenario)
    rows, _ = logged_generations(
        writer.version.model, GenerationFilter(since=timezone.now() - timedelta(1))
    )
    assert len(rows) == 1 and rows[0]["finish_reason"] == "cancelled"
    assert 1 <= len(rows[0]["completion"]) < 30 and set(rows[0]["completion"]) == {"X"}


def test_unsampled_generations_keep_and_log_nothing(writer, state):
    writer.version.model.log_sample_rate = 0.0
    writer.version.model.save()

    async def scenario():
        FakeAgent(state(), writer.version.pk)
        await openai_post(writer.key_a, "/v1/completions", {"model": "writer", "prompt": "a"})()
        assert state().genlog.flush(10)
        return state().genlog.written

    assert run(scenario) == 0
    assert log_store().files(GENERATIONS, writer.a.pk) == []


def test_api_page_and_export_with_feedback_and_tenant_isolation(writer, state, client):
    model = writer.version.model
    model.log_sample_rate = 1.0
    model.save()
    writer.version.personal_fields = {"prompt": "hash"}
    writer.version.save()

    async def scenario():
        FakeAgent(state(), writer.version.pk)
        for prompt in ("one", "two"):
            body = {"model": "writer", "prompt": prompt, "max_tokens": 3}
            await openai_post(writer.key_a, "/v1/completions", body)()
        assert state().genlog.flush(10)

    run(scenario)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {writer.key_a}"}
    listed = client.get("/api/v1/models/writer/generations", **auth).json()
    assert listed["count"] == 2
    assert {r["completion"] for r in listed["results"]} == {"ONE", "TWO"}
    assert all(r["prompt"] not in ("one", "two") for r in listed["results"])  # hashed
    first = listed["results"][0]["request_id"]
    Feedback.objects.create(tenant=writer.a, request_id=first, label=1, received_at=timezone.now())
    summary = client.get("/api/v1/models/writer/generations", **auth).json()["summary"]
    assert len(summary) == 1
    assert summary[0]["logged"] == 2 and summary[0]["labelled"] == 1
    assert summary[0]["mean_label"] == 1.0 and summary[0]["finish_reasons"] == {"length": 2}
    one = client.get(f"/api/v1/models/writer/generations?request_id={first}", **auth).json()
    assert one["count"] == 1 and one["results"][0]["label"] == 1

    exported = client.get("/api/v1/models/writer/generations?export=parquet", **auth)
    assert exported.status_code == 200
    table = pq.read_table(io.BytesIO(exported.content))
    assert table.num_rows == 2 and "tenant_id" not in table.column_names
    lines = client.get("/api/v1/models/writer/generations?export=jsonl", **auth).content
    assert [json.loads(x)["completion"] for x in lines.splitlines()] == ["ONE", "TWO"]

    bad = client.get("/api/v1/models/writer/generations?export=xml&limit=0", **auth)
    assert bad.status_code == 400 and {"export", "limit"} <= set(bad.json()["fields"])
    # Another tenant cannot see the model, by API or page.
    other = {"HTTP_AUTHORIZATION": f"Bearer {writer.key_b}"}
    assert client.get("/api/v1/models/writer/generations", **other).status_code == 404
    make_model(writer.b, "writer", task="generator")
    theirs = client.get("/api/v1/models/writer/generations", **other).json()
    assert theirs["count"] == 0 and theirs["results"] == []

    client.force_login(writer.engineer_a)
    shown = client.get("/models/writer/generations/")
    assert shown.status_code == 200
    html = shown.content.decode()
    assert "ONE" in html and "TWO" in html and 'id="generation-summary"' in html
    csv = client.get("/models/writer/generations/export/?format=csv")
    assert csv.status_code == 200 and csv.content.count(b"\n") == 3
    assert client.get("/models/writer/generations/export/?format=exe").status_code == 400


def test_retention_and_compaction_keep_the_generation_log_too(writer):
    """The housekeeping tasks drop a generator's hours past its retention and merge a closed
    hour's files, as for predictions."""
    model = writer.version.model
    model.log_retention_days = 2
    model.save()
    r = Route(
        tenant_id=model.tenant_id,
        model_name=model.name,
        version_id=writer.version.pk,
        model_id=model.pk,
        version=1,
        task="generator",
        inputs=(),
        outputs=(),
        feature_names=(),
        generates_text=True,
        log_sample_rate=1.0,
    )
    now = time.time()
    store = log_store()
    for age_hours in (72, 72, 5, 5):  # two files in an expired hour, two in a kept one
        at = now - age_hours * 3600
        store.write(GENERATIONS, generation_table([sample(r)._replace(at=at)], KEY))
    assert len(store.files(GENERATIONS, model.tenant_id, [model.pk])) == 4
    assert compact_closed_hours() == 1  # the recent hour: the old one is past its lookback
    assert len(store.files(GENERATIONS, model.tenant_id, [model.pk])) == 3
    assert purge_expired_logs()["log_partitions"] == 1
    (kept,) = store.files(GENERATIONS, model.tenant_id, [model.pk])
    assert store.row_count([kept]) == 2
