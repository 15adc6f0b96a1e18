"""An uploaded artifact's bytes, read where they lie: a file the server spooled to disk (or one
registered by reference) is checked in place, never read into memory whole."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager

from django.core.files.base import File


class FileOnDisk(File[bytes]):
    """A file already on this machine's disk (an artifact registered by reference): checked
    in place like a spooled upload, but copied into storage, never moved."""

    def __init__(self, path: str) -> None:
        super().__init__(open(path, "rb"), name=path)  # noqa: SIM115 - File owns and closes it
        self.path_on_disk = path


def on_disk(upload: File[bytes]) -> str | None:
    """The path of an upload the server spooled to disk (Django's temporary upload file), or
    of a ``FileOnDisk``."""
    if isinstance(upload, FileOnDisk):
        return upload.path_on_disk
    path = getattr(upload, "temporary_file_path", None)
    return path() if path is not None else None


@contextmanager
def contents(upload: File[bytes]) -> Iterator[bytes | mmap.mmap]:
    """The upload's bytes: mapped from disk (read only where looked at) when it is there."""
    path = on_disk(upload)
    if path is None:
        upload.seek(0)
        yield upload.read()
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        yield mapped
