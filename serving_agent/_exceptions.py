"""Errors the agent reports, each carrying the wire error code a request gets for it."""

from __future__ import annotations

from .protocol import ErrorCode


class AgentError(Exception):
    """Base class; ``code`` is the ``InferError.code`` a request failing with it gets."""

    code: ErrorCode = "internal"


class BadInput(AgentError, ValueError):
    """A request whose tensors do not fit the version's signature."""

    code: ErrorCode = "bad_input"


class Overloaded(AgentError):
    """The version's queue is full; the caller should retry elsewhere or later."""

    code: ErrorCode = "overloaded"


class OverShare(Overloaded):
    """The tenant holds its share of a shared version's queue; others are waiting (429)."""

    code: ErrorCode = "over_share"


class Expired(AgentError):
    """The request's deadline passed before it could run; it was never computed."""

    code: ErrorCode = "expired"


class Cancelled(AgentError):
    """The caller gave up (a cancel frame) while the request was queued; never computed."""

    code: ErrorCode = "cancelled"


class NotLoaded(AgentError):
    """The version is not ready on this agent (never assigned, still loading, or unloaded)."""

    code: ErrorCode = "not_loaded"


class ModelFailed(AgentError):
    """A version's own code failed a batch: a ``python`` package's handler raised, or its
    worker crashed, overran its deadline or its memory and was killed (a 500 naming why)."""

    code: ErrorCode = "internal"


class ChecksumMismatch(AgentError):
    """A downloaded artifact whose sha256 is not the one the platform promised."""
