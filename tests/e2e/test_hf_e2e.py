"""Hugging Face causal LMs with real processes: a Llama-family and a GPT-2-family model (tiny,
random weights, made here with a BPE tokenizer trained here) uploaded as ``hf`` archives,
stream through the websocket and the stock OpenAI client with exactly the tokens transformers
generates greedily in this process; 16 concurrent streams batched on the agent get what each
gets alone; an archive with a pickle, remote code or an escaping path is refused with a 400."""

from __future__ import annotations

import io
import json
import re
import tarfile
import threading
from typing import Any

import httpx
import openai
import pytest
from websockets.sync.client import connect

from tests.hf_models import make_archive, reference_greedy

from .conftest import platform_with_agent, wait_ready
from .harness import create_tenant, metrics_auth, wait_until

pytestmark = pytest.mark.e2e

FAMILIES = ("llama", "gpt2")
LIMITS = {"format": "hf", "max_input_tokens": "64", "max_output_tokens": "64"}


class Family:
    def __init__(self, name: str, archive: bytes, model: Any, tokenizer: Any) -> None:
        self.name, self.archive, self.model, self.tokenizer = name, archive, model, tokenizer

    def expected(self, prompt: str, max_tokens: int) -> tuple[str, int]:
        """transformers' greedy text (an unfinished last character is never sent) and its
        token count."""
        tokens = reference_greedy(self.model, self.tokenizer, prompt, max_tokens)
        return self.tokenizer.decode(tokens).rstrip("\ufffd"), len(tokens)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    out = {}
    for name in FAMILIES:
        archive, model, tokenizer = make_archive(name, tmp_path_factory.mktemp(name))
        out[name] = Family(name, archive, model, tokenizer)
    return out


# Tenant t, with room for 16 streams at once (the default quota is 8).
SEED = (
    ("tenant", "t"),
    (
        "shell",
        "from tenants.models import Quota, Tenant; Quota.objects.update_or_create("
        "tenant=Tenant.objects.get(slug='t'), defaults={'max_concurrent_streams': 32})",
    ),
)


# One backend: nothing on the hf path differs between them (the streaming e2e runs the same
# gateway code on both), and the module stays under a minute.
@pytest.fixture(scope="module", params=["embedded"])
def platform(request, tmp_path_factory, families):
    tmp = tmp_path_factory.mktemp(f"hf-{request.param}")
    env = {"SWITCHYARD_AGENT_HEARTBEAT_S": "0.5"}
    with platform_with_agent(request.param, tmp, env, seed=SEED) as (backend, url, procs):
        key = create_tenant(backend, "t")
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as api:
            for name, family in families.items():
                created = api.post("/api/v1/models", json={"name": name, "task": "generator"})
                assert created.status_code == 201, created.text
                files = {"artifact": (f"{name}.tar.gz", family.archive, "application/gzip")}
                version = api.post(f"/api/v1/models/{name}/versions", files=files, data=LIMITS)
                assert version.status_code == 201, version.text
                moved = api.put(f"/api/v1/models/{name}/aliases/production", json={"version": 1})
                assert moved.status_code == 200, moved.text
            for name in families:
                wait_ready(api, name, timeout=60, proc=procs[1])
            yield backend, url, key, api


def ws_url(url: str, model: str) -> str:
    return url.replace("http://", "ws://") + f"/ws/v1/models/{model}/generate"


def stream(ws, sid: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    ws.send(
        json.dumps(
            {
                "type": "generate",
                "id": sid,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
            }
        )
    )
    text = []
    while True:
        frame = json.loads(ws.recv(timeout=60))
        assert frame["id"] == sid and frame["type"] != "error", frame
        if frame["type"] == "done":
            return "".join(text), frame
        text.append(frame["text"])


@pytest.mark.parametrize("name", FAMILIES)
def test_websocket_streams_equal_transformers_greedy(platform, families, name):
    _, url, key, _ = platform
    family = families[name]
    headers = {"Authorization": f"Bearer {key}"}
    with connect(ws_url(url, name), additional_headers=headers) as ws:
        for prompt in ("Once upon a time", "¡Hola! Grüße — 日本語"):
            text, done = stream(ws, "g", prompt, 24)
            expected, count = family.expected(prompt, 24)
            assert text.rstrip("\ufffd") == expected
            assert done["usage"]["output_tokens"] == count
            assert done["usage"]["input_tokens"] == len(family.tokenizer.encode(prompt).ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_openai_client_gets_the_same_tokens_and_the_chat_template(platform, families, name):
    _, url, key, _ = platform
    family = families[name]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    expected, count = family.expected("The quick brown fox", 16)
    whole = client.completions.create(
        model=name, prompt="The quick brown fox", max_tokens=16, temperature=0
    )
    assert whole.choices[0].text.rstrip("\ufffd") == expected
    assert whole.usage.completion_tokens == count
    assert whole.usage.prompt_tokens == len(family.tokenizer.encode("The quick brown fox").ids)
    streamed = client.completions.create(
        model=name, prompt="The quick brown fox", max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    scraped = httpx.get(f"{url}/metrics", headers=metrics_auth(), timeout=10).text
    assert re.search(
        rf'^switchyard_generation_inter_token_latency_seconds_count{{[^}}]*model="{name}"',
        scraped,
        re.M,
    )

    # The template (tests/hf_models.CHAT_TEMPLATE) renders on the agent: its tokens are the
    # prompt's, and the answer is what transformers continues that rendering with.
    rendered = "<s><|user|>hello there</s><|assistant|>"
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=12,
        temperature=0,
    )
    ids = family.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert chat.usage.prompt_tokens == len(ids)
    reference = reference_greedy_ids(family, ids, 12)
    assert chat.choices[0].message.content.rstrip("\ufffd") == reference


def test_the_input_limit_is_enforced_in_the_models_own_tokens(platform, families):
    """64 tokens of this tokenizer, not 64 bytes: a prompt of 100 bytes that encodes to fewer
    passes, one that encodes to more is refused with a 400 naming its real count."""
    _, url, key, _ = platform
    tokenizer = families["llama"].tokenizer
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    short = "Once upon a time " * 5
    assert len(short.encode()) > 64 and len(tokenizer.encode(short).ids) <= 64
    client.completions.create(model="llama", prompt=short, max_tokens=2, temperature=0)
    long = "日本語のテキスト " * 12
    count = len(tokenizer.encode(long).ids)
    with pytest.raises(openai.BadRequestError, match=f"prompt is {count} tokens"):
        client.completions.create(model="llama", prompt=long, max_tokens=2, temperature=0)


def reference_greedy_ids(family: Family, ids: list[int], max_tokens: int) -> str:
    import torch

    with torch.inference_mode():
        out = family.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return family.tokenizer.decode(out[0, len(ids) :].tolist()).rstrip("\ufffd")


def test_sixteen_concurrent_streams_batched_equal_each_alone(platform, families):
    """Each stream's text is what transformers generates for its prompt alone, while the
    agent decoded them together."""
    backend, url, key, _ = platform
    headers = {"Authorization": f"Bearer {key}"}
    prompts = {f"s{i}": f"{'Once upon a time ' * (i % 4)}story {i}" for i in range(16)}
    together: dict[str, str] = {}
    start = threading.Barrier(len(prompts))

    def one(sid: str, prompt: str) -> None:
        with connect(ws_url(url, "llama"), additional_headers=headers) as ws:
            start.wait(30)
            together[sid] = stream(ws, sid, prompt, 16)[0].rstrip("\ufffd")

    threads = [threading.Thread(target=one, args=item) for item in prompts.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    alone = {sid: families["llama"].expected(p, 16)[0] for sid, p in prompts.items()}
    assert together == alone
    # The agent's heartbeat reports its largest decode batch so far.
    batch = lambda: backend.agent_stats().get("max_decode_batch", 0)  # noqa: E731
    wait_until(lambda: batch() >= 8, 10)


def tar_with(archive: bytes, name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(archive)) as src,
        tarfile.open(fileobj=out, mode="w:gz") as tar,
    ):
        for member in src:
            if member.name != name:
                tar.addfile(member, src.extractfile(member))
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_pickles_remote_code_and_escaping_paths_are_refused_with_a_400(platform, families):
    import pickle

    _, _, _, api = platform
    archive = families["gpt2"].archive
    config = json.loads(tarfile.open(fileobj=io.BytesIO(archive)).extractfile("config.json").read())
    remote = json.dumps(config | {"auto_map": {"AutoModelForCausalLM": "x.Y"}}).encode()
    cases = {
        "pytorch_model.bin": tar_with(archive, "pytorch_model.bin", b"\x80\x04whatever"),
        "is a pickle": tar_with(archive, "extra.safetensors", pickle.dumps([1], protocol=4)),
        "remote code": tar_with(archive, "config.json", remote),
        "leaves the model directory": tar_with(archive, "../../etc/cron.d/x", b"{}"),
    }
    for problem, data in cases.items():
        files = {"artifact": ("m.tar.gz", data, "application/gzip")}
        refused = api.post("/api/v1/models/gpt2/versions", files=files, data=LIMITS)
        assert refused.status_code == 400, refused.text
        assert problem in refused.text and "artifact" in refused.text
