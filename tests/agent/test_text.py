"""A version with a tokenizer on the agent: the tokenizer is fetched by its own URL and hash,
like the artifact (a mismatch fails the version), and the loaded version answers text through
its batcher with one embedding and one token count per row."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from platform_site.demo import minilm
from serving_agent import ChecksumMismatch
from serving_agent.protocol import ARTIFACT_PATH, TOKENIZER_PATH, TensorSpec, VersionSpec
from tests.agent.test_versions import HEADERS, PLATFORM, assign, make_versions

pytestmark = pytest.mark.anyio
TOKENIZER_SHA = "b" * 64


class TwoFileCache:
    """The MiniLM export for the artifact's URL, its tokenizer.json for the tokenizer's, or a
    checksum mismatch for the tokenizer when told."""

    def __init__(self, bad_tokenizer: bool = False) -> None:
        self.bad_tokenizer = bad_tokenizer
        self.fetched: list[tuple[str, str]] = []

    async def fetch(self, url: str, sha256: str, headers: Mapping[str, str]) -> Path:
        assert dict(headers) == HEADERS
        self.fetched.append((url, sha256))
        if url.endswith(TOKENIZER_PATH.format(version_id=1)):
            if self.bad_tokenizer:
                raise ChecksumMismatch(f"sha256 mismatch: expected {sha256}")
            return minilm.tokenizer_path()
        return minilm.exported()


def spec() -> VersionSpec:
    return VersionSpec(
        version_id=1,
        model="minilm",
        version=1,
        sha256="a" * 64,
        artifact_url=ARTIFACT_PATH.format(version_id=1),
        inputs=[TensorSpec(name="text", datatype="BYTES", shape=[-1])],
        outputs=[
            TensorSpec(name="sentence_embedding", datatype="FP32", shape=[-1, 384]),
            TensorSpec(name="token_count", datatype="INT64", shape=[-1]),
        ],
        max_batch_size=4,
        tokenizer_url=TOKENIZER_PATH.format(version_id=1),
        tokenizer_sha256=TOKENIZER_SHA,
    )


async def test_the_tokenizer_is_fetched_by_its_hash_and_the_version_answers_text() -> None:
    cache = TwoFileCache()
    versions, statuses = make_versions(cache)
    versions.apply(assign(spec()))
    await statuses.expect("ready", 1, timeout=60)
    assert cache.fetched == [
        (PLATFORM + ARTIFACT_PATH.format(version_id=1), "a" * 64),
        (PLATFORM + TOKENIZER_PATH.format(version_id=1), TOKENIZER_SHA),
    ]
    texts = np.array([b"hello world", "grüße".encode()], dtype=object)
    (vectors, counts), _, _ = await versions.loaded[1].batcher.infer_timed({"text": texts})
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert counts.tolist()[0] == 4  # [CLS] hello world [SEP]
    await versions.shutdown()


async def test_a_tokenizer_that_fails_its_checksum_fails_the_version() -> None:
    versions, statuses = make_versions(TwoFileCache(bad_tokenizer=True))
    versions.apply(assign(spec()))
    failed = await statuses.expect("failed", 1)
    assert failed.detail == f"sha256 mismatch: expected {TOKENIZER_SHA}"
    assert versions.loaded == {}
    await versions.shutdown()
