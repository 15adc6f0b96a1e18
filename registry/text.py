"""ONNX versions that take text: a tokenizer (``tokenizers``' tokenizer.json) attached at upload
makes the agent tokenize a BYTES ``text`` input into the graph's token inputs, so the version's
signature takes text in place of ``input_ids`` / ``attention_mask`` / ``token_type_ids`` and
gives, besides the graph's outputs, each row's ``token_count`` (what usage is billed on)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from django.conf import settings
from django.core.files.base import File

from .signature import SignatureError

# The graph inputs a tokenizer fills, by their Hugging Face names; input_ids is required.
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TEXT_INPUT = "text"
TOKEN_COUNT = "token_count"
# A tokenizer.json is a vocabulary and merges: tens of MiB at most for real ones.
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
CHECK_TIMEOUT_S = 60


def check_tokenizer(upload: File[bytes]) -> None:
    """Refuse a tokenizer that is too large or does not load and encode in a child process."""
    if not upload.size:
        raise SignatureError("tokenizer", "the uploaded file is empty")
    if upload.size > MAX_TOKENIZER_BYTES:
        raise SignatureError("tokenizer", f"larger than the limit of {MAX_TOKENIZER_BYTES} bytes")
    upload.seek(0)
    data = upload.read()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "registry.tokenizer_check"],
            input=data,
            cwd=settings.BASE_DIR,
            capture_output=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
        )
        answer = json.loads(done.stdout)
    except subprocess.TimeoutExpired:
        raise SignatureError("tokenizer", "loading the tokenizer took too long") from None
    except ValueError:  # the child died
        raise SignatureError(
            "tokenizer", "not a valid tokenizer.json: the checker failed"
        ) from None
    if "error" in answer:
        raise SignatureError("tokenizer", answer["error"])


def text_signature(
    inputs: list[dict[str, Any]], outputs: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The signature of a graph served behind its tokenizer; refuses a graph a tokenizer cannot
    feed (inputs other than token ids, masks and type ids, or not integer [batch, sequence])."""
    names = [t["name"] for t in inputs]
    if "input_ids" not in names or set(names) - set(TOKEN_INPUTS):
        raise SignatureError(
            "tokenizer",
            f"a tokenizer feeds graphs whose inputs are among {list(TOKEN_INPUTS)} "
            f"(input_ids required); this graph takes {names}",
        )
    for t in inputs:
        if t["datatype"] not in ("INT64", "INT32") or len(t["shape"]) != 2:
            raise SignatureError(
                "tokenizer",
                f"graph input {t['name']!r} must be INT64 or INT32 [batch, sequence]; "
                f"it is {t['datatype']} {t['shape']}",
            )
    if any(t["name"] == TOKEN_COUNT for t in outputs):
        raise SignatureError("tokenizer", f"the graph already has an output {TOKEN_COUNT!r}")
    return (
        [{"name": TEXT_INPUT, "datatype": "BYTES", "shape": [-1]}],
        [*outputs, {"name": TOKEN_COUNT, "datatype": "INT64", "shape": [-1]}],
    )
