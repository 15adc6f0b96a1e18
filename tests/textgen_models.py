"""Small text-generation artifacts for tests (no Django here, so any process can import it)."""

from __future__ import annotations


def tiny_textgen(seed: int = 0) -> bytes:
    """An untrained switchyard-bytegpt-v1 (2 layers, 2 heads, 32 wide, 64 positions) as
    safetensors bytes: fast to load and run, deterministic given the seed."""
    import torch

    from serving_agent.textgen import TextGenConfig, TextGenModel, to_safetensors

    torch.manual_seed(seed)
    model = TextGenModel(TextGenConfig(context=64, n_layer=2, n_head=2, n_embd=32))
    return to_safetensors(model)
