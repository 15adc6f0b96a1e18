"""The upload check of ``hf`` versions: a Hugging Face causal LM as one archive.

The rules live with the agent, which checks again before it extracts
(``serving_agent.hf_archive``); here a refusal becomes the upload's 400, naming the problem.
"""

from __future__ import annotations

from typing import IO

from django.conf import settings

from serving_agent.hf_archive import Manifest, check_archive, weight_files

from .signature import SignatureError
from .weights import Tensor, Weights, safetensors_weights


def _max_total() -> int:
    # An archive may expand to a few times its compressed size, never unboundedly.
    return 4 * settings.SWITCHYARD_MAX_ARTIFACT_BYTES


def check_hf_archive(source: str | IO[bytes]) -> Manifest:
    """Check an uploaded archive (a path on disk, or a file object) without running anything
    from it: no pickle, no remote code, no path leaving the model directory, bounded sizes."""
    try:
        return check_archive(source, max_total=_max_total())
    except ValueError as exc:
        raise SignatureError("artifact", f"not a valid hf archive: {exc}") from None


def hf_weights(source: str | IO[bytes]) -> Weights:
    """The floating-point tensors of a checked archive's ``*.safetensors`` files, named
    ``<file>:<tensor>``."""
    for short, f in weight_files(source, max_total=_max_total()):
        for tensor in safetensors_weights(f):
            yield Tensor(f"{short}:{tensor.name}", tensor.size, tensor.pieces)
