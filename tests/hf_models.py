"""Tiny Hugging Face causal LMs for tests: a Llama- or GPT-2-family model with random weights
and a BPE tokenizer trained here (the demo's builders, platform_site.demo.llama_storyteller),
saved as a model directory and packed as an ``hf`` archive. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from platform_site.demo import llama_storyteller
from platform_site.demo.llama_storyteller import CHAT_TEMPLATE, save_model_dir
from serving_agent.hf_archive import pack

__all__ = ["CHAT_TEMPLATE", "make_archive", "reference_greedy", "save_model_dir", "tiny_model"]

CORPUS = [
    "Once upon a time there was a small robot who liked to read books.",
    "The quick brown fox jumps over the lazy dog. ¡Hola! Grüße, naïve café — 日本語のテキスト.",
    "User: hello there\nAssistant: hi, how can I help you today?",
    "Switchyard serves models: it batches requests and streams tokens to many clients.",
] * 8


def train_tokenizer(vocab_size: int = 320) -> Any:
    """The demo's byte-level BPE tokenizer, trained on a few sentences."""
    return llama_storyteller.train_tokenizer(CORPUS, vocab_size)


def tiny_model(family: str, vocab_size: int, seed: int = 0, **sizes: int) -> Any:
    """A random-init causal LM of ``family`` ("llama" or "gpt2"). Weights are drawn wider than
    transformers' default so greedy choices are clear (no near ties between logits)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hidden, layers, heads = sizes.get("hidden", 64), sizes.get("layers", 2), sizes.get("heads", 4)
    common = {"vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if family == "llama":
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=sizes.get("context", 512),
            initializer_range=0.2,
            tie_word_embeddings=False,
            **common,
        )
        model: Any = LlamaForCausalLM(config)
    elif family == "gpt2":
        config2 = GPT2Config(
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=sizes.get("context", 512),
            initializer_range=0.2,
            **common,
        )
        model = GPT2LMHeadModel(config2)
    else:
        raise ValueError(family)
    return model.eval()


def make_archive(family: str, directory: Path, seed: int = 0) -> tuple[bytes, Any, Any]:
    """A tiny model of ``family`` as an ``hf`` archive, with the model and tokenizer it holds
    (for reference generations in the test process)."""
    tokenizer = train_tokenizer()
    model = tiny_model(family, tokenizer.get_vocab_size(), seed)
    save_model_dir(model, tokenizer, directory)
    return pack(directory), model, tokenizer


def reference_greedy(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation of ``prompt``: the tokens after the prompt (EOS
    included when it comes)."""
    import torch

    ids = tokenizer.encode(prompt).ids
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]
