"""Token streaming with real processes: the ASGI server (uvicorn), a serving agent running the
torch engine, and Redis + PostgreSQL (or the embedded default). A websocket client receives
tokens incrementally; several streams share decode steps and each gets exactly its solo text;
closing or cancelling stops decoding at the agent; an agent killed mid-stream ends the stream
with an error frame; the stock OpenAI client library works against /v1."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from websockets.sync.client import connect

from .conftest import BACKENDS, platform_with_agent, wait_ready
from .harness import create_tenant, metrics_auth, wait_until

pytestmark = pytest.mark.e2e

MODEL = "writer"
# A context long enough that a stream can run for seconds: cancellation must cut it short.
LONG = {"context": 1024, "n_layer": 2, "n_head": 2, "n_embd": 32}


def textgen_artifact(**config) -> bytes:
    import torch

    from serving_agent.textgen import TextGenConfig, TextGenModel, to_safetensors

    torch.manual_seed(0)
    return to_safetensors(TextGenModel(TextGenConfig(**config)))


@pytest.fixture(scope="module", params=BACKENDS)
def platform(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"streaming-{request.param}")
    env = {"SWITCHYARD_AGENT_HEARTBEAT_S": "0.5"}
    with platform_with_agent(request.param, tmp, env, seed=(("tenant", "t"),)) as (
        backend,
        url,
        procs,
    ):
        key = create_tenant(backend, "t")
        # Generous: uploading a version on a slow machine (the server validates the artifact)
        # took longer than httpx's default 5 s.
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as api:
            # Every generation logged: the generation log's test reads them back.
            body = {"name": MODEL, "task": "generator", "log_sample_rate": 1.0}
            created = api.post("/api/v1/models", json=body)
            assert created.status_code == 201, created.text
            files = {"artifact": ("w.safetensors", textgen_artifact(**LONG), "application/x")}
            limits = {"format": "textgen", "max_input_tokens": "64", "max_output_tokens": "900"}
            version = api.post(f"/api/v1/models/{MODEL}/versions", files=files, data=limits)
            assert version.status_code == 201, version.text
            moved = api.put(f"/api/v1/models/{MODEL}/aliases/production", json={"version": 1})
            assert moved.status_code == 200, moved.text
            wait_ready(api, MODEL, timeout=60, proc=procs[1])
        yield backend, url, key, procs


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + f"/ws/v1/models/{MODEL}/generate"


def generate(ws, stream_id: str, prompt: str, **params) -> list[dict]:
    ws.send(json.dumps({"type": "generate", "id": stream_id, "prompt": prompt} | params))
    frames = []
    while True:
        frame = json.loads(ws.recv(timeout=60))
        frames.append(frame)
        if frame["id"] == stream_id and frame["type"] in ("done", "error"):
            return frames


def text_of(frames: list[dict]) -> str:
    return "".join(f["text"] for f in frames if f["type"] == "token")


def agent_stats(backend) -> dict:
    return backend.agent_stats()


def inter_token_observations(url: str) -> float:
    """The count of the inter-token latency histogram of the test's model, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    scraped = httpx.get(f"{url}/metrics", headers=metrics_auth(), timeout=30)
    assert scraped.status_code == 200, scraped.text
    for family in text_string_to_metric_families(scraped.text):
        for sample in family.samples:
            if (
                sample.name == "switchyard_generation_inter_token_latency_seconds_count"
                and sample.labels.get("model") == MODEL
            ):
                return sample.value
    return 0.0


def test_tokens_arrive_incrementally_with_right_usage(platform):
    backend, url, key, _ = platform
    observed = inter_token_observations(url)
    with connect(ws_url(url), additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        frames = generate(ws, "g1", "Call me Ishmael.", max_tokens=40, temperature=0)
    tokens = [f for f in frames if f["type"] == "token"]
    done = frames[-1]
    assert done["type"] == "done", done
    assert len(tokens) >= 2 and frames.index(tokens[-1]) < len(frames) - 1
    usage = done["usage"]
    assert usage["input_tokens"] == len(b"Call me Ishmael.")
    assert usage["output_tokens"] == sum(t["tokens"] for t in tokens) == 40
    assert done["finish_reason"] == "length"
    assert 0 < usage["ttft_ms"] <= usage["total_ms"] and usage["tokens_per_second"] > 0
    # Every token after the first chunk's is one inter-token latency observation.
    assert inter_token_observations(url) - observed == 40 - tokens[0]["tokens"]


def test_concurrent_streams_share_decode_steps_and_match_their_solo_text(platform):
    backend, url, key, _ = platform
    prompts = {f"s{i}": f"{'Whale ' * i}ahoy {i}" for i in range(4)}
    headers = {"Authorization": f"Bearer {key}"}
    with connect(ws_url(url), additional_headers=headers) as ws:
        solo = {
            sid: text_of(generate(ws, sid, p, max_tokens=60, temperature=0))
            for sid, p in prompts.items()
        }
    together: dict[str, str] = {}

    def one(sid: str, prompt: str) -> None:
        with connect(ws_url(url), additional_headers=headers) as ws:
            together[sid] = text_of(generate(ws, sid, prompt, max_tokens=60, temperature=0))

    threads = [threading.Thread(target=one, args=item) for item in prompts.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert together == solo
    wait_until(lambda: agent_stats(backend).get("max_decode_batch", 0) >= 2, 10)


def test_cancel_and_closing_stop_decoding_on_the_agent(platform):
    backend, url, key, _ = platform
    before = agent_stats(backend)
    headers = {"Authorization": f"Bearer {key}"}
    with connect(ws_url(url), additional_headers=headers) as ws:
        ws.send(json.dumps({"type": "generate", "id": "c", "prompt": "Go", "max_tokens": 900}))
        first = json.loads(ws.recv(timeout=30))
        assert first["type"] == "token"
        ws.send(json.dumps({"type": "cancel", "id": "c"}))
        while (frame := json.loads(ws.recv(timeout=30)))["type"] == "token":
            pass
        assert frame == {"type": "done", "id": "c", "finish_reason": "cancelled"}
        ws.send(json.dumps({"type": "generate", "id": "d", "prompt": "Go", "max_tokens": 900}))
        assert json.loads(ws.recv(timeout=30))["type"] == "token"
    # The socket is closed mid-stream: the agent stops that one too.

    def both_cancelled() -> bool:
        stats = agent_stats(backend)
        return stats["streams_cancelled_total"] - before["streams_cancelled_total"] == 2

    wait_until(both_cancelled, 10)
    time.sleep(1.0)  # a stream that kept decoding would keep adding tokens
    generated = agent_stats(backend)["tokens_generated_total"] - before["tokens_generated_total"]
    assert generated < 900  # two streams of up to 900 tokens each were cut short


def test_limits_and_bad_input_get_error_frames(platform):
    _, url, key, _ = platform
    with connect(ws_url(url), additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        long_prompt = generate(ws, "a", "x" * 65)[-1]
        too_many = generate(ws, "b", "x", max_tokens=901)[-1]
        ws.send("{not json")
        malformed = json.loads(ws.recv(timeout=10))
    assert long_prompt["code"] == "bad_request" and "at most 64" in long_prompt["message"]
    assert too_many["code"] == "bad_request" and "at most 900" in too_many["message"]
    assert malformed["code"] == "bad_request"
    with connect(ws_url(url), additional_headers={"Authorization": "Bearer sy_nope_nope"}) as ws:
        assert json.loads(ws.recv(timeout=10))["code"] == "unauthorized"


def test_the_openai_client_library_works_unchanged(platform):
    _, url, key, _ = platform
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    whole = client.completions.create(model=MODEL, prompt="The sea", max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    streamed = client.completions.create(
        model=MODEL, prompt="The sea", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sy_bad_key", max_retries=0).models.list()
    assert MODEL in [m.id for m in client.models.list()]


def test_generations_are_logged_with_what_was_asked_and_answered(platform):
    """The gateway process's generation log, read back over the API: the stock client's
    stream, its prompt, its text, the real agent's token counts and the finish reason."""
    _, url, key, procs = platform
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    marker = f"Logbook {time.time_ns() % 10**6}"
    streamed = client.completions.create(
        model=MODEL, prompt=marker, max_tokens=9, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as api:

        def logged() -> list[dict]:
            page = api.get(f"/api/v1/models/{MODEL}/generations", params={"limit": 500})
            assert page.status_code == 200, page.text
            return [r for r in page.json()["results"] if r["prompt"] == marker]

        (row,) = wait_until(logged, timeout=30, proc=procs[0])  # the writer flushes every 2 s
        exported = api.get(f"/api/v1/models/{MODEL}/generations", params={"export": "csv"})
    assert row["completion"] == text and row["door"] == "openai.completions"
    assert (row["input_tokens"], row["output_tokens"]) == (len(marker.encode()), 9)
    assert row["finish_reason"] == "length" and row["status"] == 200
    assert row["params"]["max_tokens"] == 9 and row["ttft_ms"] > 0
    assert exported.status_code == 200 and marker in exported.text


def test_a_stream_still_waiting_for_a_slot_past_its_deadline_is_dropped_unrun(platform):
    """One slot (max_streams=1), taken by a long stream: a stream with a short deadline waits
    and is answered 504 (OpenAI) / a timeout frame (socket) without a token; the agent counts
    it as expired."""
    backend, url, key, procs = platform
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as api:
        created = api.post("/api/v1/models", json={"name": "narrow", "task": "generator"})
        assert created.status_code == 201, created.text
        files = {"artifact": ("w.safetensors", textgen_artifact(**LONG), "application/x")}
        limits = {"format": "textgen", "max_output_tokens": "900", "max_streams": "1"}
        version = api.post("/api/v1/models/narrow/versions", files=files, data=limits)
        assert version.status_code == 201, version.text
        moved = api.put("/api/v1/models/narrow/aliases/production", json={"version": 1})
        assert moved.status_code == 200, moved.text
        wait_ready(api, "narrow", timeout=60, proc=procs[1])
        before = agent_stats(backend).get("expired_total", 0)
        narrow = url.replace("http://", "ws://") + "/ws/v1/models/narrow/generate"
        with connect(narrow, additional_headers=headers) as ws:
            hold = {"type": "generate", "id": "hold", "prompt": "Go", "max_tokens": 900}
            ws.send(json.dumps(hold))
            assert json.loads(ws.recv(timeout=30))["type"] == "token"  # the slot is taken
            late = api.post(
                "/v1/completions",
                json={"model": "narrow", "prompt": "Hi", "max_tokens": 4},
                headers={"X-Switchyard-Timeout-Ms": "50"},
            )
            frames = generate(ws, "late", "Hi", max_tokens=4, timeout_ms=50, priority="batch")
            ws.send(json.dumps({"type": "cancel", "id": "hold"}))
    assert late.status_code == 504, late.text
    assert "past its budget" in late.json()["error"]["message"]
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "timeout", frames[-1]
    assert not [f for f in frames if f["id"] == "late" and f["type"] == "token"]
    wait_until(lambda: agent_stats(backend).get("expired_total", 0) - before >= 2, 10)


def test_an_agent_killed_mid_stream_ends_the_stream_with_an_error(platform):
    _, url, key, procs = platform
    agent = procs[1]
    with connect(ws_url(url), additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        ws.send(json.dumps({"type": "generate", "id": "k", "prompt": "Go", "max_tokens": 900}))
        assert json.loads(ws.recv(timeout=30))["type"] == "token"
        agent.popen.kill()
        killed_at = time.monotonic()
        while (frame := json.loads(ws.recv(timeout=30)))["type"] == "token":
            pass
    assert frame["type"] == "error" and frame["code"] == "agent_failed", frame
    assert time.monotonic() - killed_at < 10
