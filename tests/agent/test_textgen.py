"""The generative architecture: byte tokens, the detokenizer, the safe artifact, the KV cache."""

from __future__ import annotations

import io
import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import save

from serving_agent.textgen import (
    ARCHITECTURE,
    Detokenizer,
    KVCache,
    TextGenConfig,
    TextGenModel,
    encode,
    from_safetensors,
    generate,
    read_config,
    to_safetensors,
)
from tests.textgen_models import tiny_textgen

TINY = TextGenConfig(context=64, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def artifact() -> bytes:
    return tiny_textgen()


@pytest.fixture(scope="module")
def model(artifact: bytes) -> TextGenModel:
    return from_safetensors(artifact, "cpu")


# Tokens ----------------------------------------------------------------------------------------


def test_tokens_are_utf8_bytes() -> None:
    assert encode("Call me") == list(b"Call me")
    assert encode("é🐳") == [0xC3, 0xA9, 0xF0, 0x9F, 0x90, 0xB3]
    assert encode("") == []


def test_the_detokenizer_never_splits_a_multibyte_character() -> None:
    text = "whale – 鯨 🐳!"
    detok = Detokenizer()
    pieces = [detok.push(t) for t in encode(text)]
    assert "".join(pieces) == text
    # Each character comes out whole, on its last byte; the bytes before give nothing.
    assert [p for p in pieces if p] == list(text)
    assert pieces[encode(text).index(0xF0) : encode(text).index(0xF0) + 3] == ["", "", ""]


def test_the_detokenizer_replaces_invalid_bytes_and_drops_an_unfinished_character() -> None:
    detok = Detokenizer()
    assert detok.push(0xFF) == "\ufffd"
    assert detok.push(0xE9) == ""  # the first of three bytes
    assert detok.flush() == ""  # the stream ended: half a character is never emitted
    assert detok.push(ord("a")) == "a"


# The artifact ----------------------------------------------------------------------------------


def test_an_artifact_round_trips_with_its_config(artifact: bytes, model: TextGenModel) -> None:
    assert read_config(artifact) == TINY
    torch.manual_seed(0)
    original = TextGenModel(TINY).eval()  # tiny_textgen(seed=0) is this model
    tokens = torch.tensor([encode("Call me Ishmael.")])
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens), original(tokens), rtol=0, atol=0)
    again = from_safetensors(to_safetensors(model))
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def _header(data: bytes) -> dict:
    (length,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + length])


def _with_metadata(data: bytes, **metadata: str) -> bytes:
    model = from_safetensors(data)
    tensors = {n: t.contiguous() for n, t in model.state_dict().items()}
    return save(tensors, metadata={**_header(data)["__metadata__"], **metadata})


def test_read_config_refuses_a_file_that_is_not_safetensors() -> None:
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_config(b"ONNX? no, just some bytes that are not a model at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_config(b"\x01")


def test_read_config_refuses_a_pickle(artifact: bytes) -> None:
    state = from_safetensors(artifact).state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # a zip of pickles: what a .pt / .bin checkpoint is
    for data in (buffer.getvalue(), pickle.dumps({"weights": [1.0, 2.0]})):
        with pytest.raises(ValueError, match="not a safetensors file"):
            read_config(data)


def test_read_config_refuses_another_architecture(artifact: bytes) -> None:
    with pytest.raises(ValueError, match="architecture is 'llama'"):
        read_config(_with_metadata(artifact, architecture="llama"))
    plain = save({"w": torch.zeros(2)})  # a valid safetensors file with no metadata at all
    with pytest.raises(ValueError, match="architecture is None"):
        read_config(plain)


def test_read_config_refuses_tensors_that_do_not_match_the_config(artifact: bytes) -> None:
    wider = TextGenConfig(context=64, n_layer=2, n_head=2, n_embd=64)
    with pytest.raises(ValueError, match="has shape"):
        read_config(_with_metadata(artifact, config=wider.to_json()))
    deeper = TextGenConfig(context=64, n_layer=3, n_head=2, n_embd=32)
    with pytest.raises(ValueError, match="missing"):
        read_config(_with_metadata(artifact, config=deeper.to_json()))
    with pytest.raises(ValueError, match="multiple of n_head"):
        bad = json.dumps({**json.loads(TINY.to_json()), "n_head": 3})
        read_config(_with_metadata(artifact, config=bad))
    with pytest.raises(ValueError, match="vocab_size"):
        bad = json.dumps({**json.loads(TINY.to_json()), "vocab_size": 50257})
        read_config(_with_metadata(artifact, config=bad))


def test_read_config_refuses_a_truncated_file(artifact: bytes) -> None:
    with pytest.raises(ValueError, match="offsets"):
        read_config(artifact[:-4])


def test_loading_runs_no_code_from_the_file(artifact: bytes) -> None:
    # The only loader is safetensors; a pickle payload inside metadata is just a string.
    data = _with_metadata(artifact, note=pickle.dumps(print).hex())
    assert read_config(data) == TINY
    assert isinstance(from_safetensors(data), TextGenModel)


# The KV cache ----------------------------------------------------------------------------------


def test_decoding_with_the_kv_cache_gives_the_full_recompute_logits(model: TextGenModel) -> None:
    tokens = torch.tensor([encode("It is a way I have of driving off the spleen.")])
    cache = KVCache(model.config, rows=3)
    with torch.inference_mode():
        full = model(tokens)
        steps = [model(tokens[:, :12], torch.tensor([0]), cache, row=2)]  # prefill, in row 2
        for i in range(12, tokens.shape[1]):
            steps.append(model(tokens[:, i : i + 1], torch.tensor([i]), cache, row=2))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_streams_of_different_lengths_decode_in_one_call(model: TextGenModel) -> None:
    prompts = [encode(p) for p in ("Call me Ishmael.", "Whale", "x", "Some years ago, never mind")]
    cache = KVCache(model.config, rows=len(prompts))
    with torch.inference_mode():
        for row, p in enumerate(prompts):
            if len(p) > 1:
                model(torch.tensor([p[:-1]]), torch.tensor([0]), cache, row)
        last = torch.tensor([[p[-1]] for p in prompts])
        start = torch.tensor([len(p) - 1 for p in prompts])
        batched = model(last, start, cache)[:, -1]
        alone = torch.stack([model(torch.tensor([p]))[0, -1] for p in prompts])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    assert batched.argmax(-1).tolist() == alone.argmax(-1).tolist()


def test_generate_stops_at_the_end_of_the_context(model: TextGenModel) -> None:
    generate(model, "a" * model.config.context, 100)  # a full context still gives one token
    assert generate(model, "Call me", 10) == generate(model, "Call me", 10)


def test_a_position_past_the_context_is_refused(model: TextGenModel) -> None:
    with pytest.raises(ValueError, match="past the context"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_the_architecture_name_is_in_the_file(artifact: bytes) -> None:
    metadata = _header(artifact)["__metadata__"]
    assert metadata["architecture"] == ARCHITECTURE == "switchyard-bytegpt-v1"
    assert TextGenConfig.from_json(metadata["config"]) == TINY
