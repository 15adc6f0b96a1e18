"""Hugging Face causal LMs on the generation engine, without processes: greedy streams equal
transformers' own ``generate``, streams batched together equal the same streams alone, chat
templates, stop strings and EOS, and honest token counts from the real tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from serving_agent import hf_archive
from serving_agent._generate import Engine
from serving_agent._hf import HFDecoder, load_model
from serving_agent.protocol import ChatTurn, GenerateDone, GenerateRequest, GenerationLimits
from tests.agent.test_generate import Collector, until
from tests.hf_models import CHAT_TEMPLATE, make_archive, reference_greedy

pytestmark = pytest.mark.anyio

PROMPTS = [
    "Once upon a time",
    "The quick brown fox",
    "Switchyard serves models:",
    "¡Hola! Grüße, naïve café — 日本語",
    "hello",
    "User: hello there",
    "It batches requests and streams tokens",
    "a",
]


class Served:
    def __init__(self, model: Any, tokenizer: Any, decoder: HFDecoder) -> None:
        self.model, self.tokenizer, self.decoder = model, tokenizer, decoder


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    tmp = tmp_path_factory.mktemp(request.param)
    data, model, tokenizer = make_archive(request.param, tmp / "src")
    (tmp / "a.tar.gz").write_bytes(data)
    hf_archive.extract(tmp / "a.tar.gz", tmp / "x")
    return Served(model, tokenizer, HFDecoder(load_model(tmp / "x", "cpu"), tmp / "x", 256))


def greedy(request_id: int, prompt: str, n: int, **fields: Any) -> GenerateRequest:
    return GenerateRequest(
        id=request_id, version_id=1, prompt=prompt, max_new_tokens=n, temperature=0.0, **fields
    )


async def run(engine: Engine, reqs: list[GenerateRequest], stagger: bool = False) -> Collector:
    out = Collector()
    for i, req in enumerate(reqs):
        if stagger:  # join a running batch at different steps
            await until(lambda n=i: engine.stats.decode_steps_total >= n)
        engine.submit(req, out)
    await out.wait(*(r.id for r in reqs), timeout=60)
    return out


async def test_greedy_streams_equal_transformers_generate(served: Served) -> None:
    engine = Engine(served.decoder, GenerationLimits(max_streams=4))
    reqs = [greedy(i, p, 12) for i, p in enumerate(PROMPTS[:4])]
    out = await run(engine, reqs)
    await engine.stop()
    for req in reqs:
        expected = reference_greedy(served.model, served.tokenizer, req.prompt, 12)
        done = out.end(req.id)
        assert isinstance(done, GenerateDone)
        # A character left unfinished at the end is never sent (decode shows it as U+FFFD).
        text = served.tokenizer.decode(expected).rstrip("\ufffd")
        assert out.text(req.id).rstrip("\ufffd") == text, req.prompt
        assert done.output_tokens == len(expected)
        assert done.input_tokens == len(served.tokenizer.encode(req.prompt).ids)
        assert done.finish_reason == ("stop" if expected[-1] == 2 else "length")


async def test_sixteen_streams_batched_equal_each_alone(served: Served) -> None:
    reqs = [greedy(i, PROMPTS[i % 8] + " " * (i // 8), 8 + i % 5) for i in range(16)]
    alone = {}
    for req in reqs:
        engine = Engine(served.decoder)
        out = await run(engine, [req])
        await engine.stop()
        alone[req.id] = (out.text(req.id), out.end(req.id).output_tokens)
    engine = Engine(served.decoder, GenerationLimits(max_streams=16))
    out = await run(engine, reqs, stagger=True)
    await engine.stop()
    assert engine.stats.max_decode_batch >= 8
    assert engine.stats.decode_steps_total < sum(n for _, n in alone.values())
    for req in reqs:
        assert (out.text(req.id), out.end(req.id).output_tokens) == alone[req.id], req.id


async def test_a_chat_is_rendered_with_the_models_template(served: Served) -> None:
    from jinja2 import Template

    messages = [ChatTurn("system", "Be brief."), ChatTurn("user", "hello there")]
    rendered = Template(CHAT_TEMPLATE).render(
        messages=[{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert served.decoder.chat_prompt(messages) == rendered
    ids = served.decoder.encode_chat(messages)
    assert ids == served.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(1) == 1  # the template's BOS, not a second one

    engine = Engine(served.decoder)
    out = await run(engine, [greedy(0, "ignored", 6, messages=messages)])
    await engine.stop()
    assert out.end(0).input_tokens == len(ids)


async def test_a_stop_string_cuts_the_text_and_sampling_is_seeded(served: Served) -> None:
    engine = Engine(served.decoder, GenerationLimits(max_streams=4))
    full = await run(engine, [greedy(0, "hello", 20)])
    text = full.text(0)
    if len(text) > 4:
        stop = text[2:4]
        cut = await run(engine, [greedy(1, "hello", 20, stop=[stop])])
        assert cut.text(1) == text[: text.index(stop)]
        assert cut.end(1).finish_reason == "stop"
    sampled = [
        GenerateRequest(id=10 + i, version_id=1, prompt="hello", temperature=1.0, seed=7)
        for i in range(2)
    ]
    out = await run(engine, sampled)
    assert out.text(10) == out.text(11)
    await engine.stop()


async def test_a_prompt_past_the_limit_is_refused_in_real_tokens(served: Served) -> None:
    from serving_agent._exceptions import BadInput

    engine = Engine(served.decoder, GenerationLimits(max_input_tokens=5))
    prompt = "Once upon a time there was"
    tokens = len(served.tokenizer.encode(prompt).ids)
    with pytest.raises(BadInput, match=f"prompt is {tokens} tokens"):
        engine.submit(greedy(0, prompt, 4), Collector())
    await engine.stop()
    await asyncio.sleep(0)


def test_the_kv_cache_is_preallocated_per_stream(served: Served, tmp_path: Path) -> None:
    layers, heads, context, head_dim = served.decoder.kv_shape
    assert context == 256 and layers == 2
    cache = served.decoder.new_cache(3)
    assert cache.k.numel() * 4 * 2 == 3 * served.decoder.bytes_per_row


def test_a_template_saved_by_transformers_renders_as_apply_chat_template(tmp_path: Path) -> None:
    """transformers writes the template to chat_template.jinja; the agent's rendering and
    tokenization equal ``apply_chat_template``'s."""
    from transformers import PreTrainedTokenizerFast

    from tests.hf_models import tiny_model, train_tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    source = tmp_path / "model"
    tiny_model("gpt2", tokenizer.vocab_size).save_pretrained(source)
    tokenizer.save_pretrained(source)
    assert (source / "chat_template.jinja").exists()
    (tmp_path / "a.tar.gz").write_bytes(hf_archive.pack(source))
    hf_archive.extract(tmp_path / "a.tar.gz", tmp_path / "x")
    decoder = HFDecoder(load_model(tmp_path / "x", "cpu"), tmp_path / "x", 64)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi ¡olé!"}]
    expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    turns = [ChatTurn(m["role"], m["content"]) for m in chat]
    assert decoder.encode_chat(turns) == expected["input_ids"]


def test_top_k_samples_only_among_the_k_likeliest_tokens() -> None:
    import torch

    from serving_agent.textgen import sample

    logits = torch.tensor([0.0, 3.0, 2.9, 2.8, -1.0])
    generator = torch.Generator().manual_seed(0)
    assert {sample(logits, 1.0, 1.0, generator, top_k=1) for _ in range(50)} == {1}
    assert {sample(logits, 2.0, 1.0, generator, top_k=2) for _ in range(200)} == {1, 2}
    assert len({sample(logits, 2.0, 1.0, generator) for _ in range(400)}) >= 4


async def test_loading_extracts_warms_up_and_allocates_every_streams_row(
    tmp_path: Path,
) -> None:
    """The agent's load: the archive extracted next to itself, the KV cache allocated at
    max_streams (so the measured memory holds it), CUDA asked for falls back to the CPU here."""
    import torch

    from serving_agent._hf import extract_dir, load_hf_engine
    from serving_agent.protocol import VersionSpec

    data, _, tokenizer = make_archive("gpt2", tmp_path / "src")
    path = tmp_path / "abc.hf"
    path.write_bytes(data)
    spec = VersionSpec(
        version_id=1,
        model="m",
        version=1,
        sha256="0" * 64,
        artifact_url="/a",
        format="hf",
        inputs=[],
        outputs=[],
        device="cuda",
        generation=GenerationLimits(max_input_tokens=20, max_output_tokens=12, max_streams=6),
    )
    engine, warm_s = load_hf_engine(path, spec)
    assert (extract_dir(path) / ".complete").exists() and warm_s > 0
    assert engine.provider == ("torch-cuda" if torch.cuda.is_available() else "torch-cpu")
    assert engine.cache.rows == 6 and engine.model.context == 32
    out = await run(engine, [greedy(0, "hello", 12)])
    await engine.stop()
    assert out.end(0).output_tokens <= 12
    assert out.end(0).input_tokens == len(tokenizer.encode("hello").ids)


def test_a_template_refusing_the_messages_is_a_bad_input(tmp_path: Path) -> None:
    from serving_agent._exceptions import BadInput

    data, _, _ = make_archive("gpt2", tmp_path / "src")
    config_path = tmp_path / "src" / "tokenizer_config.json"
    import json

    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{{ messages | tojson }}"
    )
    config_path.write_text(json.dumps(config))
    (tmp_path / "b.tar.gz").write_bytes(hf_archive.pack(tmp_path / "src"))
    hf_archive.extract(tmp_path / "b.tar.gz", tmp_path / "x")
    decoder = HFDecoder(load_model(tmp_path / "x", "cpu"), tmp_path / "x", 64)
    assert decoder.chat_prompt([ChatTurn("user", "olé")]).startswith("olé[{")
    assert "olé" in decoder.chat_prompt([ChatTurn("user", "olé")])[3:]  # tojson keeps it
    with pytest.raises(BadInput, match="no system messages"):
        decoder.encode_chat([ChatTurn("system", "x"), ChatTurn("user", "hi")])
    engine = Engine(decoder)
    with pytest.raises(BadInput, match="chat template"):
        engine.submit(greedy(0, "x", 4, messages=[ChatTurn("system", "x")]), Collector())
