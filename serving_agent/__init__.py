"""Switchyard serving agent: runs on each GPU/CPU node and serves the models the platform assigns.

Never imports Django: it talks to the platform only over the wire protocol in ``protocol``.

The names below are imported on first use (PEP 562): the platform imports small parts of this
package (``protocol``, ``torch_archive``, ``hf_archive``) in every Django process, and importing
the agent itself with them (httpx, websockets, onnxruntime) cost each process ~0.35 s of start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .__version__ import __version__

if TYPE_CHECKING:
    from ._agent import Agent
    from ._batcher import Batcher, SchedCounts
    from ._cache import ArtifactCache
    from ._connection import AuthRejected, backoff_delay, ws_url
    from ._exceptions import (
        AgentError,
        BadInput,
        Cancelled,
        ChecksumMismatch,
        Expired,
        NotLoaded,
        Overloaded,
        OverShare,
    )
    from ._facts import node_facts
    from ._runtime import FunctionRuntime, OnnxRuntime, Runtime, load_runtime, warm_up
    from ._serving import Stats

# Each exported name -> the module that defines it.
_EXPORTS = {
    "Agent": "._agent",
    "Batcher": "._batcher",
    "SchedCounts": "._batcher",
    "ArtifactCache": "._cache",
    "AuthRejected": "._connection",
    "backoff_delay": "._connection",
    "ws_url": "._connection",
    "AgentError": "._exceptions",
    "BadInput": "._exceptions",
    "Cancelled": "._exceptions",
    "ChecksumMismatch": "._exceptions",
    "Expired": "._exceptions",
    "NotLoaded": "._exceptions",
    "Overloaded": "._exceptions",
    "OverShare": "._exceptions",
    "node_facts": "._facts",
    "FunctionRuntime": "._runtime",
    "OnnxRuntime": "._runtime",
    "Runtime": "._runtime",
    "load_runtime": "._runtime",
    "warm_up": "._runtime",
    "Stats": "._serving",
}

# A literal list, so that linters see what the TYPE_CHECKING imports above are for.
__all__ = [
    "Agent",
    "AgentError",
    "ArtifactCache",
    "AuthRejected",
    "BadInput",
    "Batcher",
    "Cancelled",
    "ChecksumMismatch",
    "Expired",
    "FunctionRuntime",
    "NotLoaded",
    "OnnxRuntime",
    "OverShare",
    "Overloaded",
    "Runtime",
    "SchedCounts",
    "Stats",
    "__version__",
    "backoff_delay",
    "load_runtime",
    "node_facts",
    "warm_up",
    "ws_url",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value
