"""A python package that streams text (format ``python_generator``, docs/custom-code.md,
"Streaming text") with real processes: tests/packages/word_echo uploaded through the API, its
environment built by a real agent, its generators run in a sandboxed worker, and its text
streamed over the websocket and the OpenAI routes (completions and chat, streamed or not, with
the stock client), with the usage each reports; the agent's rules (max tokens, stop strings)
hold, and a generator that raises ends its stream with an error frame.

One platform, on the embedded backend: the format runs on the agent, and streams take the same
gateway path on both backends (tests/e2e/test_streaming_e2e.py covers those).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from websockets.sync.client import connect

from tests.python_packages import PACKAGES, pack

from .conftest import make_backend
from .harness import create_node, create_tenant, free_port, start_agent, start_server, wait_until

pytestmark = pytest.mark.e2e

MODEL = "echo"
BUILD_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("python-generator")
    backend = make_backend("embedded", tmp)
    backend.env["SWITCHYARD_SANDBOX_DIR"] = str(tmp / "sandbox")
    port = free_port()
    server = start_server(backend, "uvicorn", port)
    url = f"http://127.0.0.1:{port}"
    token = create_node(backend, "node-1")
    agent = start_agent(backend, url, token)
    key = create_tenant(backend, "alpha")
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            created = client.post("/api/v1/models", json={"name": MODEL, "task": "generator"})
            assert created.status_code == 201, created.text
            files = {"artifact": ("echo.tar.gz", pack(PACKAGES / "word_echo"), "application/gzip")}
            # The plain python format refuses it, pointing to this one.
            refused = client.post(
                f"/api/v1/models/{MODEL}/versions", files=files, data={"format": "python"}
            )
            assert refused.status_code == 400, refused.text
            assert "python_generator" in refused.text
            fields = {"format": "python_generator", "max_output_tokens": "64"}
            version = client.post(f"/api/v1/models/{MODEL}/versions", files=files, data=fields)
            assert version.status_code == 201, version.text
            assert version.json()["inputs"][0]["name"] == "prompt"
            moved = client.put(f"/api/v1/models/{MODEL}/aliases/production", json={"version": 1})
            assert moved.status_code == 200, moved.text
            wait_until(
                lambda: client.get(f"/v2/models/{MODEL}/ready").status_code == 200,
                BUILD_TIMEOUT_S,
                agent,
            )
        yield url, key
    finally:
        agent.stop()
        server.stop()
        backend.close()


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


def ws_connect(url: str, key: str):
    ws_url = url.replace("http://", "ws://") + f"/ws/v1/models/{MODEL}/generate"
    return connect(ws_url, additional_headers={"Authorization": f"Bearer {key}"})


def test_the_websocket_streams_the_generators_text_with_its_usage(platform):
    url, key = platform
    prompt = "the whale  spouted twice"
    with ws_connect(url, key) as ws:
        frames = generate(ws, "g1", prompt, max_tokens=20)
        limited = generate(ws, "g2", "count", max_tokens=5)
        stopped = generate(ws, "g3", "count", max_tokens=20, stop=[" 4"])
        failed = generate(ws, "g4", "raise 2")
    tokens = [f for f in frames if f["type"] == "token"]
    done = frames[-1]
    assert text_of(frames) == "the whale spouted twice"
    assert len(tokens) >= 2 and done["type"] == "done" and done["finish_reason"] == "stop"
    assert done["usage"]["input_tokens"] == len(prompt.encode())
    assert done["usage"]["output_tokens"] == sum(t["tokens"] for t in tokens) == 4
    assert text_of(limited) == "1 2 3 4 5" and limited[-1]["finish_reason"] == "length"
    assert limited[-1]["usage"]["output_tokens"] == 5
    assert text_of(stopped) == "1 2 3" and stopped[-1]["finish_reason"] == "stop"
    assert text_of(failed) == "w0 w1 "
    assert failed[-1]["type"] == "error", failed[-1]
    assert "ValueError: asked to fail" in failed[-1]["message"]


def test_the_openai_routes_stream_it_like_any_generator(platform):
    url, key = platform
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    whole = client.completions.create(model=MODEL, prompt="call me Ishmael", max_tokens=10)
    assert whole.choices[0].text == "call me Ishmael"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.prompt_tokens == len(b"call me Ishmael")
    assert whole.usage.completion_tokens == 3
    streamed = client.completions.create(
        model=MODEL, prompt="call me Ishmael", max_tokens=10, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == "call me Ishmael"
    counted = client.completions.create(model=MODEL, prompt="count", max_tokens=3)
    assert counted.choices[0].text == "1 2 3" and counted.choices[0].finish_reason == "length"
    # A chat reaches the package as the platform's plain prompt ("User: ...\n\nAssistant:").
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=10
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "User: Hello there Assistant:"
    assert chat.usage.completion_tokens == 4
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=10,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "User: Hello there Assistant:"
    assert MODEL in [m.id for m in client.models.list()]
