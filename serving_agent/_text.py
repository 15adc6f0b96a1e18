"""Text in front of an ONNX graph: a version with a tokenizer takes one BYTES input of UTF-8
strings, one per row; ``TextRuntime`` tokenizes a whole batch (padded to its longest row,
truncated at the version's maximum length) into the graph's ``input_ids`` / ``attention_mask`` /
``token_type_ids`` and adds each row's ``token_count`` to the outputs, so usage is counted by
the tokenizer that fed the model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ._exceptions import BadInput
from ._runtime import Runtime
from .protocol import VersionSpec

TOKEN_COUNT = "token_count"
# The longest input when the tokenizer.json sets no truncation and the graph fixes no sequence
# length (BERT's 512 positions).
DEFAULT_MAX_LENGTH = 512
_INT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


class TextRuntime(Runtime):
    """A graph behind its tokenizer: ``{text: object array of bytes}`` in, the graph's outputs
    and ``token_count`` out. ``graph`` is an ``OnnxRuntime`` (its input types and shapes say
    what to feed)."""

    def __init__(self, graph: Runtime, tokenizer_path: Path, text_input: str) -> None:
        self._graph = graph
        self._feeds: dict[str, str] = dict(getattr(graph, "input_types", {}))
        shapes: dict[str, list[Any]] = dict(getattr(graph, "input_shapes", {}))
        # A graph exported with a fixed sequence length takes exactly that many tokens.
        fixed = shapes.get("input_ids", [None, None])[1:2]
        fixed_length = fixed[0] if fixed and isinstance(fixed[0], int) and fixed[0] > 0 else None
        # Imported here, not at module level: the light agent install (agent/pyproject.toml) has
        # tokenizers only with its `text` extra, and only text versions need it.
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_path))
        truncation = self._tokenizer.truncation
        self.max_length = truncation["max_length"] if truncation else DEFAULT_MAX_LENGTH
        if fixed_length is not None:
            self.max_length = fixed_length
        padding = self._tokenizer.padding or {}
        # Pad each batch to its own longest row, not to the file's fixed length (often 128):
        # short texts then cost short sequences (unless the graph fixes the length).
        self._tokenizer.enable_padding(
            pad_id=padding.get("pad_id", 0),
            pad_type_id=padding.get("pad_type_id", 0),
            pad_token=padding.get("pad_token", "[PAD]"),
            length=fixed_length,
        )
        self._tokenizer.enable_truncation(self.max_length)
        self._text = text_input
        self.input_names = [text_input]
        self.output_names = [*graph.output_names, TOKEN_COUNT]
        self.provider = graph.provider

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        texts = inputs[self._text].reshape(-1).tolist()
        try:
            strings = [t.decode() for t in texts]
        except UnicodeDecodeError as exc:
            raise BadInput(f"input {self._text!r}: not valid UTF-8 text ({exc.reason})") from None
        encodings = self._tokenizer.encode_batch(strings)
        fields = {
            "input_ids": [e.ids for e in encodings],
            "attention_mask": [e.attention_mask for e in encodings],
            "token_type_ids": [e.type_ids for e in encodings],
        }
        feed = {
            name: np.array(fields[name], dtype=_INT_TYPES.get(kind, np.int64))
            for name, kind in self._feeds.items()
        }
        outputs = self._graph.run(feed)
        counts = np.array([sum(e.attention_mask) for e in encodings], dtype=np.int64)
        return [*outputs, counts]

    def close(self) -> None:
        self._graph.close()


def text_wrapper(tokenizer: Path, spec: VersionSpec) -> Callable[[Runtime], Runtime]:
    """What ``load_runtime`` puts in front of a graph that takes tokens: its text input is the
    signature's one BYTES input."""
    if len(spec.inputs) != 1 or spec.inputs[0].datatype != "BYTES":
        raise ValueError("a version with a tokenizer takes exactly one BYTES input")
    return lambda graph: TextRuntime(graph, tokenizer, spec.inputs[0].name)
