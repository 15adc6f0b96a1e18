"""``Idempotency-Key`` on inference (OIP v2 REST, the prediction API, OpenAI's non-streaming
endpoints): a retry by the same caller (tenant and API key) within the retention window gets
the first answer back, and the agent computes once.

The hot path never queries the database for it: answers are kept in Redis when there is one
(``SET NX`` claims the key, so any gateway process sees it), else in this process, in a cache
bounded in bytes. Only a request that carries the header pays anything (measured in
``bench/oip_bench.py --idempotency``). The key's syntax and the errors are the control plane's
(``tenants.idempotency``), so every front door answers them alike.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
from django.conf import settings

from tenants import idempotency

# Stored is re-exported: the doors name the first answer as idempotency.Stored.
from tenants.idempotency import STORED_STATUSES
from tenants.idempotency import Stored as Stored
from tenants.ratelimit import RedisCircuit, redis_client

log = logging.getLogger(__name__)

HEADER = idempotency.HEADER.lower()  # as ASGI gives header names
REPLAYED = (idempotency.REPLAYED_HEADER, "true")
REDIS_PREFIX = "switchyard:idempotency:"
# Nothing below is ever held longer than this while its first call runs: by then the call has
# answered (its deadline is SWITCHYARD_INFER_TIMEOUT_S) or its process died.
PENDING_EXTRA_S = 5.0
MAX_ENTRIES = 100_000  # the local cache's bound in entries, besides its bound in bytes
ENTRY_OVERHEAD = 200  # bytes an entry costs besides its body (key, fingerprint, headers)


class _Record(msgspec.Struct, array_like=True):
    """What is kept per key: the fingerprint, and the answer once there is one (status 0:
    the first call still runs)."""

    fingerprint: str
    status: int = 0
    headers: list[tuple[str, str]] = []
    body: bytes = b""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Record).decode


def _verdict(record: _Record, fingerprint: str, key: str) -> Stored:
    """The stored answer for a retry, or the error that refuses it: ``Conflict`` while the
    first call runs, ``Unprocessable`` for another request (the draft's 409 and 422)."""
    if record.status == 0:
        raise idempotency.in_progress(key)
    if record.fingerprint != fingerprint:
        raise idempotency.reused(key)
    return Stored(record.status, list(record.headers), record.body)


@dataclass
class _Entry:
    record: _Record
    expires: float  # time.monotonic()


class LocalAnswers:
    """Answers kept in this process: the embedded default, and the fallback while Redis is
    unreachable. Bounded in bytes and entries; the oldest entries go first."""

    def __init__(self, retention_s: float, pending_s: float, max_bytes: int) -> None:
        self.retention_s, self.pending_s, self.max_bytes = retention_s, pending_s, max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.size = 0

    async def claim(self, scope: str, fingerprint: str, key: str) -> Stored | None:
        now = time.monotonic()
        entry = self._entries.get(scope)
        if entry is not None and entry.expires > now:
            return _verdict(entry.record, fingerprint, key)
        self._put(scope, _Record(fingerprint), now + self.pending_s)
        return None

    async def complete(self, scope: str, record: _Record) -> None:
        self._put(scope, record, time.monotonic() + self.retention_s)

    async def release(self, scope: str) -> None:
        self._drop(scope)

    def __contains__(self, scope: str) -> bool:
        return scope in self._entries

    def _put(self, scope: str, record: _Record, expires: float) -> None:
        self._drop(scope)
        self._entries[scope] = _Entry(record, expires)
        self.size += len(record.body) + ENTRY_OVERHEAD
        while self._entries and (self.size > self.max_bytes or len(self._entries) > MAX_ENTRIES):
            self._drop(next(iter(self._entries)))

    def _drop(self, scope: str) -> None:
        entry = self._entries.pop(scope, None)
        if entry is not None:
            self.size -= len(entry.record.body) + ENTRY_OVERHEAD


class RedisAnswers:
    """Answers kept in Redis, shared by every gateway process. While Redis is unreachable
    (``RedisCircuit``) this process keeps them itself, as the rate limiter does: a retry that
    reaches the same process is still answered once."""

    def __init__(self, url: str, local: LocalAnswers) -> None:
        self.redis = redis_client(url)
        self.local = local
        self.circuit = RedisCircuit("idempotency keys")

    async def claim(self, scope: str, fingerprint: str, key: str) -> Stored | None:
        if not self.circuit.closed:
            return await self.local.claim(scope, fingerprint, key)
        try:
            found = await self._claim(REDIS_PREFIX + scope, fingerprint)
        except Exception as exc:  # unreachable, stalled, or a reply that cannot be read
            return await self._fallback(exc).claim(scope, fingerprint, key)
        return None if found is None else _verdict(found, fingerprint, key)

    async def _claim(self, name: str, fingerprint: str) -> _Record | None:
        """None once this call holds the key, else what the key holds."""
        pending = _encode(_Record(fingerprint))
        ttl_ms = int(self.local.pending_s * 1000)
        while not await self.redis.set(name, pending, nx=True, px=ttl_ms):
            raw = await self.redis.get(name)
            if raw is not None:  # else it expired between the SET and the GET: try again
                return _decode(raw.encode() if isinstance(raw, str) else raw)
        return None

    async def complete(self, scope: str, record: _Record) -> None:
        if scope in self.local:  # claimed here while Redis was unreachable: kept here too
            await self.local.complete(scope, record)
            return
        try:
            await self.redis.set(
                REDIS_PREFIX + scope, _encode(record), ex=int(self.local.retention_s)
            )
        except Exception as exc:
            await self._fallback(exc).complete(scope, record)

    async def release(self, scope: str) -> None:
        if scope in self.local:
            await self.local.release(scope)
            return
        try:
            await self.redis.delete(REDIS_PREFIX + scope)
        except Exception as exc:
            await self._fallback(exc).release(scope)

    def _fallback(self, exc: BaseException) -> LocalAnswers:
        self.circuit.failed(exc)
        return self.local


AnswerStore = LocalAnswers | RedisAnswers


def answer_store() -> AnswerStore:
    """The store this process uses: Redis when ``REDIS_URL`` is set, else its own memory."""
    local = LocalAnswers(
        settings.SWITCHYARD_IDEMPOTENCY_RETENTION_S,
        settings.SWITCHYARD_INFER_TIMEOUT_S + PENDING_EXTRA_S,
        settings.SWITCHYARD_IDEMPOTENCY_CACHE_BYTES,
    )
    return RedisAnswers(settings.REDIS_URL, local) if settings.REDIS_URL else local


@dataclass
class Claim:
    """A request's hold on its key: ``replay`` is the first answer when this is a retry;
    otherwise the request runs and then ``keep``s its answer or ``release``s the key."""

    store: AnswerStore
    scope: str
    fingerprint: str
    replay: Stored | None

    async def keep(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        if status in STORED_STATUSES:
            await self.store.complete(self.scope, _Record(self.fingerprint, status, headers, body))
        else:  # nothing was computed that a retry must not compute again
            await self.release()

    async def release(self) -> None:
        await self.store.release(self.scope)


async def claim(
    store: AnswerStore,
    tenant_id: int,
    key_id: int,
    value: str | None,
    method: str,
    path: str,
    *body: bytes,
) -> Claim | None:
    """The claim of a request whose ``Idempotency-Key`` header is ``value``, or None without
    one. ``body``: the bytes that make the request (the body, and any header that changes how
    it reads). Raises ``Invalid`` for a malformed key, ``Conflict`` for one still in use and
    ``Unprocessable`` for one used for another request (``pipeline.claim_key`` answers them)."""
    if value is None:
        return None
    key = idempotency.parse_key(value)
    # Per tenant and key: another caller's retry with the same key is another request.
    scope = f"{tenant_id}:{key_id}:{key}"
    fingerprint = idempotency.fingerprint(method, path, *body)
    replay = await store.claim(scope, fingerprint, key)
    return Claim(store, scope, fingerprint, replay)
