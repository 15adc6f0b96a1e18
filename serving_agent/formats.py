"""The model formats this agent serves: one entry per format, naming the function that loads an
artifact of it, as KServe's model servers each implement ``Model.load``. What a loader gives
runs one of two ways: a ``Runtime`` answers batches of tensors behind a ``Batcher``
(``InferRequest`` frames); an ``Engine`` streams generated tokens (``GenerateRequest`` frames).

The platform's half is ``registry.formats`` (how an upload is checked, what OIP calls it); both
tables hold the same formats (``tests/test_formats.py``), but for the platform's composed ones
(a graph runs on the gateway, node by node: no agent loads it). Adding a format is one entry in
each.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from .protocol import VersionSpec

if TYPE_CHECKING:  # both import what they run (ONNX Runtime, torch): only when a loader is used
    from ._runtime import Runtime
    from ._streaming import GenerationEngine as Engine


class RuntimeLoader(Protocol):
    """Loads a version's artifact as a checked ``Runtime`` (signature and names as declared),
    ``wrap`` put in front of it (a tokenizer, ``_text``). Blocking: called in a thread."""

    def __call__(
        self,
        path: Path,
        spec: VersionSpec,
        threads: int = 1,
        *,
        wrap: Callable[[Runtime], Runtime] | None = None,
    ) -> Runtime: ...


# Loads a version's artifact onto a generation engine and warms it up with a tiny generation;
# returns the engine and the warm-up's seconds. Blocking: called in a thread.
EngineLoader = Callable[[Path, VersionSpec, int], "tuple[Engine, float]"]


@dataclass(frozen=True)
class Format:
    """How this agent loads one artifact format, and which way it runs."""

    # "module:function", by name: the module is imported on the first version of the format,
    # before the memory reading, so that version's footprint is its own (torch takes seconds
    # and hundreds of MiB to import, and only nodes that serve a format built on it pay).
    loader: str
    # The loader gives an ``EngineLoader``'s engine (token streams), else a ``RuntimeLoader``'s
    # runtime (batches).
    streams: bool = False
    # "module:function", an async step before the load, outside the agent's load lock (it may
    # take minutes: a python package's environment is built there), given the artifact, the
    # spec and a callback that reports progress as the version's "loading" detail.
    prepare: str | None = None

    def load_function(self) -> Callable[..., Any]:
        """The loader, its module imported (slow for torch: call it in a thread)."""
        return _named(self.loader)

    def prepare_function(self) -> Callable[..., Any] | None:
        return None if self.prepare is None else _named(self.prepare)


def _named(where: str) -> Callable[..., Any]:
    module, name = where.split(":")
    return cast(Callable[..., Any], getattr(importlib.import_module(module), name))


FORMATS: dict[str, Format] = {
    # ONNX Runtime (classic ML converted to ONNX among them).
    "onnx": Format("serving_agent._runtime:load_runtime"),
    # The built-in byte-level decoder: safetensors on the generation engine.
    "textgen": Format("serving_agent._generate:load_engine", streams=True),
    # A Hugging Face causal LM, checked and extracted, run by transformers on the same engine.
    "hf": Format("serving_agent._hf:load_hf_engine", streams=True),
    # A torch.export program, rebuilt from its checked JSON (never torch.export.load).
    "torch": Format("serving_agent._torch:load_torch"),
    # A team's own code: a package's class in a sandboxed worker process, in an environment
    # built from its pinned requirements (docs/custom-code.md).
    "python": Format(
        "serving_agent._python:load_python", prepare="serving_agent._python:prepare_python"
    ),
    # The same, for a package whose class streams text: its generators, in the worker, run
    # on a generation engine of their own (``_python_engine``).
    "python_generator": Format(
        "serving_agent._python_engine:load_python_engine",
        streams=True,
        prepare="serving_agent._python:prepare_python",
    ),
}
