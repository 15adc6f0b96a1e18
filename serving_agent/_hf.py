"""Hugging Face causal LMs (``hf`` versions) on the generation engine.

The archive is checked and extracted (``hf_archive.extract``) into the agent's cache, then
loaded with ``transformers`` from safetensors only, from local files only, never with remote
code. ``HFDecoder`` gives the engine (``_generate.Engine``) the same contract as the byte-level
model: per-row positions in a preallocated KV cache (``HFCache``, one row per stream, bounded by
the version's token limits), so continuous batching, stop strings, sampling and cancellation
work unchanged.

Each decode step hands the model its rows' cached keys and values as a ``DynamicCache`` over
the window of the longest stream; a shorter stream's unused positions are masked out through
the attention mask, and every row gets its own ``position_ids``. The new token's keys and
values are copied back into each row at its own position.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import hf_archive
from ._exceptions import BadInput
from ._generate import Detok, Engine, pick_device, plain_chat_prompt
from .protocol import ChatTurn, VersionSpec
from .textgen import KVCache

logger = logging.getLogger(__name__)

# Nothing is fetched at run time: a model is its archive.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class HFCache(KVCache):
    """Keys and values of ``rows`` streams, ``context`` positions each, for every layer, in the
    model's dtype (``move`` and ``grow`` are the byte model's cache's).

    Preallocated per row, so a replica's KV memory is rows x context x its per-token size, known
    before the first stream (``HFDecoder.bytes_per_row``).
    """

    def __init__(  # no super().__init__: the shape and dtype come from the model, not a config
        self, shape: tuple[int, int, int, int], rows: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        layers, heads, context, head_dim = shape
        full = (layers, rows, heads, context, head_dim)
        self.k = torch.zeros(full, dtype=dtype, device=device)
        self.v = torch.zeros(full, dtype=dtype, device=device)


class _Detokenizer:
    """Incremental decoding that emits only complete characters (``tokenizers``' DecodeStream
    holds a multi-byte character split over tokens until its last piece arrives)."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token: int) -> str:
        return self._stream.step(self._tokenizer, token) or ""

    def flush(self) -> str:
        return ""  # an unfinished character is dropped, not half emitted


class HFDecoder:
    """A ``transformers`` causal LM and its ``tokenizers`` tokenizer as an engine ``Decoder``."""

    def __init__(self, model: Any, directory: Path, context: int) -> None:
        from tokenizers import Tokenizer

        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer_config = _json(directory / "tokenizer_config.json")
        self.bos_token = _token_text(tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(tokenizer_config.get("eos_token"))
        template = tokenizer_config.get("chat_template")
        template_file = directory / hf_archive.CHAT_TEMPLATE_FILE
        if template_file.exists():
            template = template_file.read_text()
        env = hf_archive.chat_environment()
        self.template = env.from_string(template) if isinstance(template, str) else None
        self.eos = frozenset(self._eos_ids(model))
        config = model.config
        limit = getattr(config, "max_position_embeddings", None) or config.n_positions
        self.context = min(context, int(limit))
        # The cache argument's name: ``cache`` in recent transformers, ``past_key_values`` before.
        parameters = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in parameters else "past_key_values"
        self.kv_shape = self._probe()

    def _eos_ids(self, model: Any) -> set[int]:
        ids: set[int] = set()
        for source in (model.config, getattr(model, "generation_config", None)):
            value = getattr(source, "eos_token_id", None)
            ids.update([value] if isinstance(value, int) else value or [])
        if self.eos_token is not None and (found := self.tokenizer.token_to_id(self.eos_token)):
            ids.add(found)
        return ids

    @torch.inference_mode()
    def _probe(self) -> tuple[int, int, int, int]:
        """Layers, key-value heads, context and head size, read off one forward (so any
        supported architecture's cache layout is the one it really uses)."""
        from transformers import DynamicCache

        probe = DynamicCache()
        one = torch.tensor([[0]], device=self.device)
        self.model(
            input_ids=one,
            attention_mask=torch.ones_like(one),
            **{self.cache_kw: probe},
            use_cache=True,
        )
        layers: list[Any] = probe.layers
        _, heads, _, head_dim = layers[0].keys.shape
        return len(layers), heads, self.context, head_dim

    @property
    def bytes_per_row(self) -> int:
        layers, heads, context, head_dim = self.kv_shape
        return 2 * layers * heads * context * head_dim * self.dtype.itemsize

    # Tokenizer ---------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def start_tokens(self) -> list[int]:
        bos = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        return [bos] if bos is not None else [next(iter(self.eos), 0)]

    def detokenizer(self) -> Detok:
        return _Detokenizer(self.tokenizer)

    def chat_prompt(self, messages: Sequence[ChatTurn]) -> str:
        """The chat rendered by the model's template; ``BadInput`` (a 400) when the template
        refuses the messages (``raise_exception``, e.g. roles that do not alternate) or breaks
        the sandbox's rules."""
        from jinja2 import TemplateError

        if self.template is None:
            return plain_chat_prompt(messages)
        try:
            return str(
                self.template.render(
                    messages=[{"role": m.role, "content": m.content} for m in messages],
                    add_generation_prompt=True,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                )
            )
        except (TemplateError, ValueError, TypeError) as exc:
            raise BadInput(f"the chat template cannot render these messages: {exc}") from None

    def encode_chat(self, messages: Sequence[ChatTurn]) -> list[int]:
        """A template writes its own special tokens (as ``apply_chat_template`` does, the text
        is tokenized without adding them again)."""
        text = self.chat_prompt(messages)
        if self.template is None:
            return self.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    # Model -------------------------------------------------------------------------------------

    def new_cache(self, rows: int) -> HFCache:
        return HFCache(self.kv_shape, rows, self.dtype, self.device)

    def __call__(
        self, tokens: torch.Tensor, start: torch.Tensor, cache: Any, row: int = 0
    ) -> torch.Tensor:
        from transformers import DynamicCache

        assert isinstance(cache, HFCache)
        batch, steps = tokens.shape
        starts = start.tolist()
        window = max(starts)
        if window + steps > self.context:
            raise ValueError(f"position {window + steps - 1} is past the context of {self.context}")
        if steps > 1 and window:
            raise ValueError("a prompt is prefilled from position 0")
        device = self.device
        rows = slice(row, row + batch)
        past = DynamicCache()
        for layer in range(cache.k.shape[0]):
            past.update(cache.k[layer, rows, :, :window], cache.v[layer, rows, :, :window], layer)
        # Row b's past is its first starts[b] positions of the window; the rest is masked out.
        seen = torch.arange(window) < torch.tensor(starts)[:, None]
        mask = torch.cat([seen, torch.ones(batch, steps, dtype=torch.bool)], dim=1)
        positions = torch.tensor(starts)[:, None] + torch.arange(steps)
        out = self.model(
            input_ids=tokens.to(device),
            attention_mask=mask.to(device, torch.long),
            position_ids=positions.to(device),
            **{self.cache_kw: past},  # filled in place with the new tokens' keys and values
            use_cache=True,
        )
        b = torch.arange(batch, device=device)[:, None]
        at = positions.to(device)
        filled: list[Any] = past.layers
        for layer, kv in enumerate(filled):
            new_k = kv.keys[:, :, window:].transpose(1, 2)  # [B, T, H, D]
            new_v = kv.values[:, :, window:].transpose(1, 2)
            cache.k[layer, rows].transpose(1, 2)[b, at] = new_k
            cache.v[layer, rows].transpose(1, 2)[b, at] = new_v
        return out.logits


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_model(directory: Path, device: str) -> Any:
    """The model from an extracted archive: config.json and safetensors only, local files
    only, no remote code (the archive check already refused any ``auto_map``)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = _json(directory / "config.json")
    cls = getattr(transformers, hf_archive.SUPPORTED[hf_archive.check_config(config)])
    # Float32 on the CPU (half precision is slow or missing there); the checkpoint's own
    # precision on CUDA.
    dtype = torch.float32 if device == "cpu" else "auto"
    model = cls.from_pretrained(
        directory,
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=False,
        dtype=dtype,
    )
    return model.to(device).eval()


def extract_dir(path: Path) -> Path:
    """Where an archive in the agent's cache is extracted: next to it, named by it (the cache
    names artifacts by their hash, so one archive always lands in the same place)."""
    return path.with_name(path.name + ".hf")


def load_hf_engine(path: Path, spec: VersionSpec, threads: int = 1) -> tuple[Engine, float]:
    """Extract, load and warm up an ``hf`` version (blocking; call it in a thread). Returns the
    engine and the warm-up's seconds."""
    torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
    directory = extract_dir(path)
    hf_archive.extract(path, directory)
    limits = spec.generation
    context = (limits.max_input_tokens + limits.max_output_tokens) if limits else 768
    device = pick_device(spec.device)
    try:
        decoder = HFDecoder(load_model(directory, device), directory, context)
    except RuntimeError as exc:  # CUDA out of memory or unusable
        if device == "cpu":
            raise
        logger.warning("loading on CUDA failed (%s): running on CPU", exc)
        device = "cpu"
        decoder = HFDecoder(load_model(directory, device), directory, context)
    engine = Engine(decoder, limits, provider=f"torch-{device}", threads=threads)
    # Every stream's row up front: the memory measured after loading (what placement and
    # eviction count) then holds the KV cache at max_streams, not the weights alone.
    engine.cache.grow(engine.limits.max_streams)
    started = time.perf_counter()
    warm_up(decoder)
    logger.info(
        "hf model: %s, context %d, KV cache %d bytes per stream, %d streams",
        type(decoder.model).__name__,
        decoder.context,
        decoder.bytes_per_row,
        engine.limits.max_streams,
    )
    return engine, time.perf_counter() - started


@torch.inference_mode()
def warm_up(decoder: HFDecoder, tokens: int = 4) -> list[int]:
    """A short greedy generation through the engine's own path: allocates buffers and picks
    kernels before the first user. Returns the tokens (tests compare them)."""
    cache = decoder.new_cache(1)
    prompt = decoder.encode("Hello") or decoder.start_tokens()
    out: list[int] = []
    if len(prompt) > 1:
        decoder(torch.tensor([prompt[:-1]]), torch.tensor([0]), cache)
    token, pos = prompt[-1], len(prompt) - 1
    for _ in range(min(tokens, decoder.context - pos)):
        logits = decoder(torch.tensor([[token]]), torch.tensor([pos]), cache)
        token, pos = int(logits[0, -1].argmax()), pos + 1
        out.append(token)
    return out
