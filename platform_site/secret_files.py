"""Secrets an install makes for itself, and files under ``var/`` only their owner may read.

A default written in the source is public, so nothing secret ships: each install generates its
own on first start, kept in a 0600 file under ``var/``; an environment variable still wins.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

PRIVATE = 0o600


def private_file(path: Path) -> Path:
    """Make sure the file exists (created empty if not) with mode 0600, narrowing an older
    install's world-readable one. SQLite gives its -wal and -shm files the mode of the
    database file, so one call before the first connection covers all three."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, PRIVATE))
    _narrow(path)
    return path


def write_private(path: Path, text: str) -> None:
    """Replace the file's content atomically; it is 0600 from its first byte (mkstemp), never
    readable by others for a moment as a write-then-chmod would leave it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install_secret(path: Path, nbytes: int = 32) -> str:
    """This install's secret stored at ``path``, generated on the first call. The web server,
    the worker and beat start together: whichever links its file first wins (``os.link``
    fails when the name exists), and the others read that one, so all agree."""
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(nbytes) + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: use theirs
        finally:
            os.unlink(tmp)
    _narrow(path)
    value = path.read_text().strip()
    if not value:
        raise ImproperlyConfigured(f"{path} is empty: delete it and a new secret is generated")
    return value


def _narrow(path: Path) -> None:
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        path.chmod(PRIVATE)
