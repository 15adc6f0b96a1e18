"""The demo's Hugging Face generator: a small Llama-architecture model and a byte-level BPE
tokenizer, both trained here in seconds on the opening of Moby-Dick (nothing is downloaded),
saved as transformers saves a model and packed as an ``hf`` archive.

Plain torch, transformers and tokenizers, no Django: ``bootstrap_demo`` calls
``train_llama_storyteller``; the tests build their tiny models with the same helpers.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from serving_agent.hf_archive import pack

CORPUS = Path(__file__).parent / "data" / "moby_dick.txt"

# A chat template in the usual Jinja form: what tokenizer_config.json carries and the agent
# renders (sandboxed) for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
CONTEXT = 256
SEQ = 64
BATCH = 16
LR = 3e-3


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (every UTF-8 text encodes) with <pad>, <s> and </s>; it adds
    <s> in front of every text, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return tokenizer


def llama(vocab_size: int, hidden: int = 64, layers: int = 2, **config: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=CONTEXT,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            tie_word_embeddings=False,
            **config,
        )
    )


def save_model_dir(model: Any, tokenizer: Any, directory: Path, chat_template: bool = True) -> Path:
    """What ``save_pretrained`` writes (config.json, model.safetensors, generation_config.json)
    plus tokenizer.json and a tokenizer_config.json naming the special tokens and the chat
    template."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def train_llama_storyteller(
    seconds: float = 20.0, seed: int = 0, corpus: Path | None = None
) -> tuple[bytes, dict[str, Any]]:
    """Train the tokenizer and the model for about ``seconds``; returns (the ``hf`` archive,
    metrics and lineage for the version)."""
    import torch
    import torch.nn.functional as F

    text = (corpus or CORPUS).read_text()
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    tokenizer = train_tokenizer(paragraphs, vocab_size=512)
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)
    cut = int(len(ids) * 0.95)
    train, val = ids[:cut], ids[cut:]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = llama(tokenizer.get_vocab_size())
    model.train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    started, steps = time.perf_counter(), 0
    while (elapsed := time.perf_counter() - started) < seconds:
        for group in optimiser.param_groups:  # cosine decay over the time budget
            group["lr"] = LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / seconds)))
        starts = torch.randint(len(train) - SEQ - 1, (BATCH,), generator=generator).tolist()
        windows = torch.stack([train[s : s + SEQ + 1] for s in starts])
        logits = model(input_ids=windows[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        steps += 1
    model.eval()
    with torch.no_grad():
        windows = val[: (len(val) - 1) // CONTEXT * CONTEXT + 1]
        x = windows[:-1].view(-1, CONTEXT)
        y = windows[1:].view(-1, CONTEXT)
        val_loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
    with tempfile.TemporaryDirectory() as tmp:
        archive = pack(save_model_dir(model, tokenizer, Path(tmp) / "model"))
    train_s = time.perf_counter() - started
    details = {
        "offline_metrics": {
            "val_loss": round(val_loss, 4),
            "train_steps": steps,
            "train_seconds": round(train_s, 1),
        },
        "description": (
            f"Llama architecture, 2 layers, 64 wide, {CONTEXT} positions, BPE vocabulary of "
            f"{tokenizer.get_vocab_size()}; trained {train_s:.0f} s ({steps} steps) on the "
            f"opening of Moby-Dick, seed {seed}"
        ),
        "training_data_hash": hashlib.sha256(text.encode()).hexdigest(),
    }
    return archive, details
