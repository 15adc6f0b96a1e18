"""The demo generative model: a small byte-level GPT trained on public-domain prose for a minute
or two on the CPU (no model hub is reachable, so the platform makes its own).

Plain torch, no Django: the management commands ``make_text_model`` and ``bootstrap_demo`` call
``train_text_model``.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from serving_agent.textgen import ARCHITECTURE, TextGenConfig, TextGenModel, to_safetensors

CORPUS = Path(__file__).parent / "data" / "moby_dick.txt"

# Sized for ~90 s on 2 CPU cores, where the number of optimiser steps limits quality more than
# the width: measured there, 64 wide with small batches (~5000 steps) reached 2.55 bits per
# byte where 128 wide (~2200 steps) reached 3.06.
CONFIG = TextGenConfig(context=256, n_layer=4, n_head=2, n_embd=64)
BATCH = 8
SEQ = 128  # most windows; every fifth batch spans the full context so all positions train
LR = 5e-3
VAL_SHARE = 0.05


def split_corpus(data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation bytes as int64 tensors: the last 5 % held out."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - VAL_SHARE))
    return tokens[:cut], tokens[cut:]


def batch_of(
    tokens: torch.Tensor, size: int, length: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(tokens) - length - 1, (size,), generator=generator)
    windows = torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(model: TextGenModel, tokens: torch.Tensor) -> float:
    """Mean next-byte cross-entropy (nats) over non-overlapping full-context windows."""
    model.eval()
    length = model.config.context
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, length):
        window = tokens[start : start + length + 1]
        x, y = window[:-1][None], window[1:][None]
        logits = model(x)
        total += F.cross_entropy(logits[0], y[0], reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


def train_text_model(
    seconds: float = 90.0, seed: int = 0, corpus: Path | None = None
) -> tuple[bytes, dict[str, Any]]:
    """Train for ``seconds`` of wall time; returns (safetensors bytes, metrics and lineage).

    Deterministic given the seed up to the number of steps the time allows.
    """
    data = (corpus or CORPUS).read_bytes()
    train, val = split_corpus(data)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = TextGenModel(CONFIG)
    model.train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.01)
    started = time.perf_counter()
    steps = tokens_seen = 0
    while (elapsed := time.perf_counter() - started) < seconds:
        # Warm up, then cosine decay to a tenth over the time budget.
        progress = elapsed / seconds
        warm = min(1.0, (steps + 1) / 50)
        lr = LR * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimiser.param_groups:
            group["lr"] = lr
        length = CONFIG.context if steps % 5 == 4 else SEQ
        size = BATCH * SEQ // length
        x, y = batch_of(train, size, length, generator)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        steps += 1
        tokens_seen += x.numel()
    train_s = time.perf_counter() - started
    val_loss = evaluate(model, val)
    model.eval()
    metrics = {
        "val_loss": round(val_loss, 4),
        "bits_per_byte": round(val_loss / math.log(2), 4),
        "train_steps": steps,
        "train_seconds": round(train_s, 1),
    }
    c = CONFIG
    description = (
        f"{ARCHITECTURE}: byte-level GPT, {c.n_layer} layers, {c.n_head} heads, "
        f"{c.n_embd} wide, {c.context} positions; trained {train_s:.0f} s ({steps} steps, "
        f"{tokens_seen / 1e6:.1f} M bytes) on the opening of Moby-Dick, seed {seed}"
    )
    details = {
        "offline_metrics": metrics,
        "description": description,
        "training_data_hash": hashlib.sha256(data).hexdigest(),
    }
    return to_safetensors(model), details
