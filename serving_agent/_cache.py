"""Content-addressed artifact cache: ``<root>/<sha256>.onnx``, verified before it is used."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

import httpx

from ._exceptions import AgentError, ChecksumMismatch

logger = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1024 * 1024
_TIMEOUT = httpx.Timeout(10.0, read=60.0)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


def download_source(
    platform: str, url: str, headers: Mapping[str, str]
) -> tuple[str, Mapping[str, str]]:
    """The URL to fetch and the headers to send for an artifact URL from a version spec.

    A path is the platform's own download endpoint: the node's headers go with it. An absolute
    URL (a presigned URL straight to a bucket) gets them only when it is the platform's own
    origin: the node token must never reach a bucket or any other host. Whatever is fetched is
    verified against its sha256 all the same.
    """
    if url.startswith("/") and not url.startswith("//"):
        return platform.rstrip("/") + url, headers
    if urlsplit(url).scheme not in ("http", "https"):
        raise AgentError(f"artifact URL {url[:80]!r}: only http(s) URLs or platform paths")
    return url, headers if _origin(url) == _origin(platform) else {}


class ArtifactCache:
    """Downloads artifacts once per content hash and refuses any whose hash is wrong.

    Downloads run in a worker thread: hashing and writing a multi-GB file on the event loop
    would stall every other version's traffic.
    """

    def __init__(self, root: Path | str, client: httpx.Client | None = None) -> None:
        self.root = Path(root).expanduser()
        self._client = client or httpx.Client(timeout=_TIMEOUT, follow_redirects=True)
        self._closed = threading.Event()

    def path_for(self, sha256: str) -> Path:
        # The hash becomes a file name, so it must be exactly a hash (no path tricks).
        if not _SHA256.fullmatch(sha256):
            raise AgentError(f"invalid sha256 {sha256!r}")
        return self.root / f"{sha256}.onnx"

    async def fetch(self, url: str, sha256: str, headers: Mapping[str, str]) -> Path:
        """The local path of the artifact with this hash, downloading it from ``url`` if needed."""
        return await asyncio.to_thread(self._fetch, url, sha256.lower(), headers)

    def close(self) -> None:
        """Abort downloads in progress (so shutdown does not wait for them) and close the client."""
        self._closed.set()
        self._client.close()

    def _fetch(self, url: str, sha256: str, headers: Mapping[str, str]) -> Path:
        path = self.path_for(sha256)
        if path.exists():
            if file_sha256(path) == sha256:
                logger.info("artifact %s: cache hit", sha256[:12])
                return path
            logger.warning("artifact %s: cached file is corrupt, downloading again", sha256[:12])
            path.unlink(missing_ok=True)

        self.root.mkdir(parents=True, exist_ok=True)
        # A temp file renamed into place: a crash or a concurrent reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{sha256[:12]}-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                got = self._download(url, headers, f)
            if got != sha256:
                raise ChecksumMismatch(f"sha256 mismatch: expected {sha256}, got {got}")
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        logger.info("artifact %s: downloaded %d bytes", sha256[:12], path.stat().st_size)
        return path

    def _download(self, url: str, headers: Mapping[str, str], out: BinaryIO) -> str:
        """Stream ``url`` into ``out``, hashing on the way; returns the sha256 hex digest."""
        digest = hashlib.sha256()
        with self._client.stream("GET", url, headers=dict(headers)) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes(_CHUNK):
                if self._closed.is_set():
                    raise AgentError("artifact cache closed during the download")
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()
