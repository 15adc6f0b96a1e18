"""Switchyard serving agent: runs on each GPU/CPU node and serves the models the platform assigns.

Never imports Django: it talks to the platform only over the wire protocol in ``protocol``.
"""

from .__version__ import __version__
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
    "SchedCounts",
    "Runtime",
    "Stats",
    "__version__",
    "backoff_delay",
    "load_runtime",
    "node_facts",
    "warm_up",
    "ws_url",
]
