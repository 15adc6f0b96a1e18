"""Bearer tokens stored as hashes: ``<kind>_<prefix>_<secret>``.

The prefix is kept in clear to find the row; the token itself only as SHA-256 (the secret is
256 random bits, so a plain hash suffices) and compared in constant time. Used for tenant API
keys (``sy``) and node tokens (``syn``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_token(kind: str) -> tuple[str, str]:
    """A fresh (prefix, raw token) pair; the raw token is shown once and never stored."""
    prefix = secrets.token_hex(4)
    secret = secrets.token_urlsafe(32).replace("_", "x")
    return prefix, f"{kind}_{prefix}_{secret}"


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def token_prefix(raw: str, kind: str) -> str | None:
    """The prefix of a well-formed token of this kind, else None."""
    parts = raw.split("_")
    if len(parts) != 3 or parts[0] != kind or not parts[1] or not parts[2]:
        return None
    return parts[1]


def token_matches(raw: str, stored_hash: str) -> bool:
    return hmac.compare_digest(stored_hash, hash_token(raw))


def bearer(header_value: str | None) -> str | None:
    """The token in an ``Authorization: Bearer <token>`` header value."""
    if not header_value:
        return None
    scheme, _, token = header_value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
