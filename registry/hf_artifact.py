"""The upload check of ``hf`` versions: a Hugging Face causal LM as one archive.

The rules live with the agent, which checks again before it extracts
(``serving_agent.hf_archive``); here a refusal becomes the upload's 400, naming the problem.
"""

from __future__ import annotations

from typing import IO

from django.conf import settings

from serving_agent.hf_archive import Manifest, check_archive

from .signature import SignatureError


def check_hf_archive(source: str | IO[bytes]) -> Manifest:
    """Check an uploaded archive (a path on disk, or a file object) without running anything
    from it: no pickle, no remote code, no path leaving the model directory, bounded sizes."""
    # An archive may expand to a few times its compressed size, never unboundedly.
    max_total = 4 * settings.SWITCHYARD_MAX_ARTIFACT_BYTES
    try:
        return check_archive(source, max_total=max_total)
    except ValueError as exc:
        raise SignatureError("artifact", f"not a valid hf archive: {exc}") from None
