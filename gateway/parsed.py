"""What a codec hands the pipeline: an inference request read from any front door's body, and
the work queued to run once the reply is sent. Imports nothing of the gateway's, so codecs and
the pipeline both stand on it."""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

# Work that runs once the reply is sent (shadow copies).
After = list[Coroutine[Any, Any, None]]


@dataclass
class ParsedInfer:
    """An inference request as a codec (REST or gRPC) read it: what the pipeline runs."""

    id: str | None
    names: list[str]
    arrays: list[np.ndarray]
    outputs: list[str] | None  # None: all outputs
    binary_outputs: set[str]  # REST only: outputs to send as binary data
    parameters: object = None  # the request's parameters (priority, timeout: see schedule())
