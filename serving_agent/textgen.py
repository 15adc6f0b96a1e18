"""The one generative architecture the platform serves, and its safe artifact format.

``switchyard-bytegpt-v1`` is a small GPT-style decoder over UTF-8 bytes (vocabulary 256) with
learned positions. An artifact is a safetensors file: float32 weights plus the architecture name
and the config JSON in its metadata. Loading it runs no code from the file (no pickle), and
``read_config`` checks a file without torch touching its bytes.
"""

from __future__ import annotations

import codecs
import json
import math
import mmap
import struct
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "switchyard-bytegpt-v1"
VOCAB_SIZE = 256
NEWLINE = 10  # the first token fed for an empty prompt: "start of a paragraph"

# Bounds a config must stay within, so a hostile file cannot ask for absurd allocations.
_MAX_CONTEXT = 8192
_MAX_LAYERS = 64
_MAX_EMBD = 8192
_MAX_HEADER_BYTES = 1024 * 1024


def encode(text: str) -> list[int]:
    """Tokens of ``text``: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


class Detokenizer:
    """Turns tokens back into text one at a time, emitting only complete UTF-8 characters.

    A multi-byte character is held until its last byte arrives; an invalid sequence becomes
    U+FFFD, as ``bytes.decode(errors="replace")`` would make it.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(bytes((token,)))

    def flush(self) -> str:
        """The end of the stream: an unfinished character is dropped, not half emitted."""
        self._decoder.reset()
        return ""


@dataclass(frozen=True)
class TextGenConfig:
    vocab_size: int = VOCAB_SIZE
    context: int = 256  # positions the model has embeddings for: prompt plus output
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def check(self) -> None:
        """Raise ``ValueError`` unless this is a config the architecture can be built from."""
        if self.vocab_size != VOCAB_SIZE:
            raise ValueError(f"vocab_size must be {VOCAB_SIZE} (bytes), not {self.vocab_size}")
        for name, low, high in (
            ("context", 1, _MAX_CONTEXT),
            ("n_layer", 1, _MAX_LAYERS),
            ("n_head", 1, _MAX_EMBD),
            ("n_embd", 1, _MAX_EMBD),
        ):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"{name} must be an integer from {low} to {high}, not {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TextGenConfig:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"the config metadata is not JSON: {exc}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != known:
            raise ValueError(f"the config must have exactly the keys {sorted(known)}")
        config = cls(**data)
        config.check()
        return config


class KVCache:
    """Keys and values for ``rows`` streams of up to ``context`` positions each.

    A row costs 2 x layers x context x n_embd floats whatever its stream's length, so memory is
    bounded by the number of rows. The engine keeps its active streams in rows 0..B-1, so a
    decode step reads a view of the cache, not a copy.
    """

    def __init__(
        self, config: TextGenConfig, rows: int, device: torch.device | str = "cpu"
    ) -> None:
        shape = (config.n_layer, rows, config.n_head, config.context, config.head_dim)
        self.k = torch.zeros(shape, device=device)
        self.v = torch.zeros(shape, device=device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a stream's first ``length`` positions from row ``src`` to row ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def grow(self, rows: int) -> None:
        """Make room for more streams, keeping what the existing rows hold."""
        extra = rows - self.rows
        if extra > 0:
            pad = (self.k.shape[0], extra, *self.k.shape[2:])
            self.k = torch.cat([self.k, self.k.new_zeros(pad)], dim=1)
            self.v = torch.cat([self.v, self.v.new_zeros(pad)], dim=1)


class Attention(nn.Module):
    def __init__(self, config: TextGenConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None, row: int, pos: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        batch, steps, embd = x.shape
        q, k, v = (
            t.view(batch, steps, self.n_head, -1).transpose(1, 2)  # [B, H, T, D]
            for t in self.qkv(x).split(embd, dim=2)
        )
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keys = cache.k[self.layer, row : row + batch]  # [B, H, context, D], a view
            values = cache.v[self.layer, row : row + batch]
            b = torch.arange(batch, device=x.device)[:, None]
            keys[b, :, pos] = k.transpose(1, 2)  # each stream writes at its own positions
            values[b, :, pos] = v.transpose(1, 2)
            # A stream sees its own positions up to itself; the rest of the window (stale
            # entries, or positions only a longer stream has reached) is masked out exactly.
            mask = torch.arange(kv_len, device=x.device) <= pos[:, :, None]  # [B, T, kv_len]
            y = F.scaled_dot_product_attention(
                q, keys[:, :, :kv_len], values[:, :, :kv_len], attn_mask=mask[:, None]
            )
        return self.proj(y.transpose(1, 2).reshape(batch, steps, embd))


class Block(nn.Module):
    def __init__(self, config: TextGenConfig, layer: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = Attention(config, layer)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None, row: int, pos: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, row, pos, kv_len)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TextGenModel(nn.Module):
    """A GPT-style decoder: token and learned position embeddings, pre-norm blocks, a head."""

    def __init__(self, config: TextGenConfig) -> None:
        super().__init__()
        config.check()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.context, config.n_embd)
        blocks = [Block(config, i) for i in range(config.n_layer)]
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init)
        for block in blocks:  # GPT-2: scale residual projections by depth
            for linear in (block.attn.proj, block.out):
                nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    def forward(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor | None = None,
        cache: KVCache | None = None,
        row: int = 0,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for ``tokens`` ``[B, T]``.

        Without a cache: causal attention over the T tokens from position 0 (training).
        With a cache: batch row b is cache row ``row + b``; its tokens sit at positions
        ``start[b]``.., their keys and values are stored there, and they attend to that row's
        cached positions up to themselves. Streams of different lengths share one call.
        """
        batch, steps = tokens.shape
        device = self.device
        if cache is None:
            pos = torch.arange(steps, device=device).expand(batch, steps)
            kv_len = steps
        else:
            if start is None:
                raise ValueError("decoding with a cache needs each row's start position")
            kv_len = int(start.max()) + steps  # on the CPU tensor: no device sync
            pos = start.to(device)[:, None] + torch.arange(steps, device=device)
        if kv_len > self.config.context:
            raise ValueError(f"position {kv_len - 1} is past the context of {self.config.context}")
        x = self.wte(tokens.to(device)) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, cache, row, pos, kv_len)
        return self.head(self.ln_f(x))


def expected_tensors(config: TextGenConfig) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a model with this config, without allocating its weights."""
    with torch.device("meta"):
        model = TextGenModel(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# The artifact ----------------------------------------------------------------------------------


def to_safetensors(model: TextGenModel) -> bytes:
    """The model as a safetensors file: float32 weights, the architecture and config in metadata."""
    from safetensors.torch import save

    tensors = {
        n: t.detach().to("cpu", torch.float32).contiguous() for n, t in model.state_dict().items()
    }
    metadata = {"architecture": ARCHITECTURE, "config": model.config.to_json()}
    return save(tensors, metadata=metadata)


def read_config(data: bytes | mmap.mmap) -> TextGenConfig:
    """Check that ``data`` is a safetensors file of this architecture and return its config.

    Reads only the JSON header (no torch, no code from the file; a file mapped with ``mmap``
    is so read no further than its header) and checks the tensor names,
    shapes, dtypes and byte ranges against the config; ``ValueError`` says what is wrong.
    """
    if len(data) < 8:
        raise ValueError("not a safetensors file: shorter than its header length")
    (header_len,) = struct.unpack_from("<Q", data)
    if header_len > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise ValueError("not a safetensors file: the header length does not fit the file")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except ValueError:
        raise ValueError("not a safetensors file: the header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError("the safetensors metadata is not a JSON object")
    architecture = metadata.get("architecture")
    if architecture != ARCHITECTURE:
        raise ValueError(f"architecture is {architecture!r}; this platform serves {ARCHITECTURE!r}")
    if not isinstance(metadata.get("config"), str):
        raise ValueError("the metadata has no config")
    config = TextGenConfig.from_json(metadata["config"])

    expected = expected_tensors(config)
    if set(header) != set(expected):
        missing, extra = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
        raise ValueError(f"tensors do not match the config: missing {missing}, unexpected {extra}")
    body = len(data) - 8 - header_len
    ranges = []
    for name, shape in expected.items():
        entry = header[name]
        if not isinstance(entry, dict) or entry.get("dtype") != "F32":
            raise ValueError(f"tensor {name!r} must be F32")
        if entry.get("shape") != list(shape):
            raise ValueError(
                f"tensor {name!r} has shape {entry.get('shape')}, expected {list(shape)}"
            )
        offsets = entry.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or offsets[1] - offsets[0] != 4 * math.prod(shape)
            or not 0 <= offsets[0] <= offsets[1] <= body
        ):
            raise ValueError(f"tensor {name!r} has bad data offsets {offsets}")
        ranges.append(offsets)
    ranges.sort()
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:], strict=False)):
        raise ValueError("tensors overlap in the file")
    return config


def from_safetensors(data_or_path: bytes | str | Path, device: str = "cpu") -> TextGenModel:
    """Build the model from an artifact (checked by ``read_config`` first) on ``device``."""
    from safetensors.torch import load

    data = data_or_path if isinstance(data_or_path, bytes) else Path(data_or_path).read_bytes()
    config = read_config(data)
    with torch.device("meta"):
        model = TextGenModel(config)
    model.load_state_dict(load(data), strict=True, assign=True)
    return model.to(device).eval()


# Generation without the engine: warm-up, samples from the training command, reference tests.


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
) -> int:
    """One token from ``logits`` [vocab]: argmax at temperature 0, else nucleus sampling
    (among the ``top_k`` likeliest tokens when ``top_k`` is set)."""
    if temperature == 0 or generator is None:
        return int(logits.argmax())
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        probs, order = probs.sort(descending=True)
        probs = probs * (probs.cumsum(0) - probs < top_p)  # the smallest head holding top_p
        return int(order[torch.multinomial(probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate(
    model: TextGenModel, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> str:
    """A continuation of ``prompt`` with a one-row KV cache (greedy at temperature 0), up to
    ``max_new_tokens`` or the end of the context."""
    tokens = encode(prompt) or [NEWLINE]
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    cache = KVCache(model.config, 1, model.device)
    logits = model(torch.tensor([tokens]), torch.tensor([0]), cache)[0, -1]
    detok, out = Detokenizer(), []
    pos = len(tokens)
    for _ in range(max_new_tokens):
        token = sample(logits.float().cpu(), temperature, 1.0, generator)
        out.append(detok.push(token))
        if pos >= model.config.context:
            break
        logits = model(torch.tensor([[token]]), torch.tensor([pos]), cache)[0, -1]
        pos += 1
    return "".join(out)
