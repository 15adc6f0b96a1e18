"""The content-addressed artifact cache, over an in-memory HTTP transport."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from serving_agent import AgentError, ArtifactCache, ChecksumMismatch

pytestmark = pytest.mark.anyio

BODY = b"not really onnx, but bytes are bytes"
SHA = hashlib.sha256(BODY).hexdigest()
URL = "http://platform.test/api/v1/agent/artifacts/1"
HEADERS = {"Authorization": "Bearer node-token"}


def make_cache(root: Path, body: bytes, seen: list[httpx.Request]) -> ArtifactCache:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=body)

    return ArtifactCache(root, client=httpx.Client(transport=httpx.MockTransport(handler)))


async def test_download_is_verified_and_stored_under_its_hash(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []
    cache = make_cache(tmp_path, BODY, seen)
    path = await cache.fetch(URL, SHA, HEADERS)
    assert path == tmp_path / f"{SHA}.onnx"
    assert path.read_bytes() == BODY
    assert seen[0].headers["Authorization"] == "Bearer node-token"


async def test_a_cache_hit_skips_the_download(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []
    cache = make_cache(tmp_path, BODY, seen)
    await cache.fetch(URL, SHA, HEADERS)
    await cache.fetch(URL, SHA, HEADERS)
    assert len(seen) == 1


async def test_a_corrupt_cached_file_is_downloaded_again(tmp_path: Path) -> None:
    (tmp_path / f"{SHA}.onnx").write_bytes(b"bit rot")
    seen: list[httpx.Request] = []
    path = await make_cache(tmp_path, BODY, seen).fetch(URL, SHA, HEADERS)
    assert len(seen) == 1
    assert path.read_bytes() == BODY


async def test_a_hash_mismatch_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    cache = make_cache(tmp_path, BODY + b"tampered", [])
    with pytest.raises(ChecksumMismatch) as caught:
        await cache.fetch(URL, SHA, HEADERS)
    got = hashlib.sha256(BODY + b"tampered").hexdigest()
    assert str(caught.value) == f"sha256 mismatch: expected {SHA}, got {got}"
    assert list(tmp_path.iterdir()) == []


async def test_http_errors_propagate(tmp_path: Path) -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    with pytest.raises(httpx.HTTPStatusError):
        await ArtifactCache(tmp_path, client=client).fetch(URL, SHA, HEADERS)
    assert list(tmp_path.iterdir()) == []


async def test_a_hash_that_is_not_a_hash_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match="invalid sha256"):
        await make_cache(tmp_path, BODY, []).fetch(URL, "../../etc/passwd", HEADERS)
