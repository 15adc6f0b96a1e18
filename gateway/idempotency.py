"""``Idempotency-Key`` on inference (OIP v2 REST, the prediction API, OpenAI's non-streaming
endpoints): a retry by the same caller (tenant and API key) within the retention window gets
the first answer back, and the agent computes once.

The hot path never queries the database for it: answers are kept in Redis when there is one
(``SET NX`` claims the key, so any gateway process sees it), else in this process, in a cache
bounded in bytes. Only a request that carries the header pays anything (measured in
``bench/oip_bench.py --idempotency``). The key's syntax and the errors are the control plane's
(``tenants.idempotency``), so every front door answers them alike.

Redis is shared by every tenant (and by the channel layer, the rate limits and Celery's queue),
so what one tenant may keep there is bounded: an answer larger than ``answer_bytes`` is not
kept, nor one that would take its tenant's kept answers past ``tenant_bytes``. Such an answer
is given once, with ``Idempotency-Stored: false``, and its key released, so a retry computes
it again: a prediction acts on nothing, and a retry that computes beats one that is refused.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
from django.conf import settings

from tenants import idempotency

# Stored is re-exported: the doors name the first answer as idempotency.Stored.
from tenants.idempotency import STORED_STATUSES
from tenants.idempotency import Stored as Stored
from tenants.ratelimit import RedisUnavailable, redis_circuit, redis_client

log = logging.getLogger(__name__)

HEADER = idempotency.HEADER.lower()  # as ASGI gives header names
REPLAYED = (idempotency.REPLAYED_HEADER, "true")
NOT_STORED = (idempotency.STORED_HEADER, "false")
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
    tenant: int

    @property
    def size(self) -> int:
        return len(self.record.body) + ENTRY_OVERHEAD


class LocalAnswers:
    """Answers kept in this process: the embedded default, and the fallback while Redis is
    unreachable. Bounded in bytes and entries, the oldest entries first out; and per tenant
    (``tenant_bytes``), so that one tenant cannot push every other tenant's answers out.

    ``answer_bytes`` and ``tenant_bytes`` (the largest answer kept, and one tenant's kept
    answers together) are the bounds ``RedisAnswers`` keeps too; unset, only the cache's own
    bounds hold."""

    def __init__(
        self,
        retention_s: float,
        pending_s: float,
        max_bytes: int,
        answer_bytes: int = sys.maxsize,
        tenant_bytes: int = sys.maxsize,
    ) -> None:
        self.retention_s, self.pending_s, self.max_bytes = retention_s, pending_s, max_bytes
        self.answer_bytes, self.tenant_bytes = answer_bytes, tenant_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.size = 0
        self._tenant_size: dict[int, int] = {}

    async def claim(self, tenant: int, scope: str, fingerprint: str, key: str) -> Stored | None:
        now = time.monotonic()
        entry = self._entries.get(scope)
        if entry is not None and entry.expires > now:
            return _verdict(entry.record, fingerprint, key)
        self._put(_Entry(_Record(fingerprint), now + self.pending_s, tenant), scope)
        return None

    async def complete(self, tenant: int, scope: str, record: _Record) -> bool:
        """Keep ``record`` for the key's retries; False, the key released, when its tenant's
        kept answers would pass ``tenant_bytes``."""
        self._drop(scope)  # the claim: its place goes to the answer
        now = time.monotonic()
        self._drop_expired(now)
        entry = _Entry(record, now + self.retention_s, tenant)
        if self._tenant_size.get(tenant, 0) + entry.size > self.tenant_bytes:
            return False
        self._put(entry, scope)
        return True

    async def release(self, scope: str) -> None:
        self._drop(scope)

    def __contains__(self, scope: str) -> bool:
        return scope in self._entries

    def _put(self, entry: _Entry, scope: str) -> None:
        self._drop(scope)
        self._entries[scope] = entry
        self._count(entry, entry.size)
        while self._entries and (self.size > self.max_bytes or len(self._entries) > MAX_ENTRIES):
            self._drop(next(iter(self._entries)))

    def _drop(self, scope: str) -> None:
        entry = self._entries.pop(scope, None)
        if entry is not None:
            self._count(entry, -entry.size)

    def _drop_expired(self, now: float) -> None:
        """Answers are appended as they are kept and all live ``retention_s``, so the expired
        ones are at the front (a claim there, still running, stops the sweep until the next)."""
        while self._entries:
            scope, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                return
            self._drop(scope)

    def _count(self, entry: _Entry, size: int) -> None:
        self.size += size
        left = self._tenant_size.get(entry.tenant, 0) + size
        if left:
            self._tenant_size[entry.tenant] = left
        else:
            del self._tenant_size[entry.tenant]


# A tenant's kept answers are counted in Redis in one hash of time buckets
# (switchyard:idempotency:bytes:<tenant>): a field is when a bucket ends (Unix ms), its value
# the bytes of the answers that expire within it. An answer adds its bytes to the bucket of its
# expiry; a bucket that has ended counts only expired answers and is dropped. So nothing is
# decremented and no list of answers is walked; an answer counts at most one bucket (the
# retention / BUDGET_BUCKETS) past its own expiry, and a tenant keeps a little less than its
# budget, never more (as it does when maxmemory evicts an answer, which counts until its bucket
# ends). The hash expires with its last bucket: a tenant that stops leaves nothing behind.
BUDGET_BUCKETS = 16
BUDGET_PREFIX = REDIS_PREFIX + "bytes:"
# Keep an answer unless it would take its tenant past its budget: atomically (two gateway
# processes cannot both take the last bytes), on Redis's clock (the same for every process),
# and in the one round trip that a SET took. KEYS: the answer's key, the tenant's hash. ARGV:
# the answer, its bytes, the budget (bytes), its lifetime and the buckets' width (ms).
# Returns 1 when kept; 0 when not, its claim deleted so that a retry computes.
_KEEP_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local width = tonumber(ARGV[5])
local ends = (math.floor((now + tonumber(ARGV[4])) / width) + 1) * width
local used, last = 0, ends
local buckets = redis.call('HGETALL', KEYS[2])
for i = 1, #buckets, 2 do
  local bucket_ends = tonumber(buckets[i])
  if bucket_ends <= now then
    redis.call('HDEL', KEYS[2], buckets[i])
  else
    used = used + tonumber(buckets[i + 1])
    last = math.max(last, bucket_ends)
  end
end
if used + tonumber(ARGV[2]) > tonumber(ARGV[3]) then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
redis.call('HINCRBY', KEYS[2], string.format('%d', ends), ARGV[2])
redis.call('PEXPIREAT', KEYS[2], string.format('%d', last))
return 1
"""


class RedisAnswers:
    """Answers kept in Redis, shared by every gateway process. While Redis is unreachable
    (the process's circuit of that server, shared with the rate limiter: ``redis_circuit``)
    this process keeps them itself, as the rate limiter does: a retry that reaches the same
    process is still answered once."""

    def __init__(self, url: str, local: LocalAnswers) -> None:
        self.redis = redis_client(url)
        self.local = local
        self.circuit = redis_circuit(url)
        self._keep = self.redis.register_script(_KEEP_SCRIPT)
        self._retention_ms = int(local.retention_s * 1000)
        self._bucket_ms = max(self._retention_ms // BUDGET_BUCKETS, 1)

    @property
    def answer_bytes(self) -> int:
        return self.local.answer_bytes

    async def claim(self, tenant: int, scope: str, fingerprint: str, key: str) -> Stored | None:
        # A key claimed or answered here while Redis was away stays here (as ``complete`` and
        # ``release`` do): a retry that comes once the circuit has closed again is still given
        # the answer this process kept, instead of computing it a second time.
        if not self.circuit.closed or scope in self.local:
            return await self.local.claim(tenant, scope, fingerprint, key)
        try:
            found = await self.circuit.call(self._claim, REDIS_PREFIX + scope, fingerprint)
        except Exception as exc:  # unreachable, stalled, or a reply that cannot be read
            return await self._fallback(exc).claim(tenant, scope, fingerprint, key)
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

    async def complete(self, tenant: int, scope: str, record: _Record) -> bool:
        """Keep ``record`` for the key's retries; False, the key released, when its tenant's
        kept answers would pass ``tenant_bytes`` (``_KEEP_SCRIPT``)."""
        if scope in self.local:  # claimed here while Redis was unreachable: kept here too
            return await self.local.complete(tenant, scope, record)
        name, answer = REDIS_PREFIX + scope, _encode(record)
        cost, budget = len(name) + len(answer), self.local.tenant_bytes
        try:
            kept = await self.circuit.call(
                self._keep,
                [name, f"{BUDGET_PREFIX}{tenant}"],
                [answer, cost, budget, self._retention_ms, self._bucket_ms],
            )
        except Exception as exc:
            return await self._fallback(exc).complete(tenant, scope, record)
        return bool(kept)

    async def release(self, scope: str) -> None:
        if scope in self.local:
            await self.local.release(scope)
            return
        try:
            await self.circuit.call(self.redis.delete, REDIS_PREFIX + scope)
        except Exception as exc:
            await self._fallback(exc).release(scope)

    def _fallback(self, exc: BaseException) -> LocalAnswers:
        if not isinstance(exc, RedisUnavailable):  # call() reported Redis's own failures
            self.circuit.failed(exc)
        return self.local


AnswerStore = LocalAnswers | RedisAnswers


def answer_store() -> AnswerStore:
    """The store this process uses: Redis when ``REDIS_URL`` is set, else its own memory."""
    local = LocalAnswers(
        settings.SWITCHYARD_IDEMPOTENCY_RETENTION_S,
        settings.SWITCHYARD_INFER_TIMEOUT_S + PENDING_EXTRA_S,
        settings.SWITCHYARD_IDEMPOTENCY_CACHE_BYTES,
        settings.SWITCHYARD_IDEMPOTENCY_MAX_ANSWER_BYTES,
        settings.SWITCHYARD_IDEMPOTENCY_TENANT_BYTES,
    )
    return RedisAnswers(settings.REDIS_URL, local) if settings.REDIS_URL else local


@dataclass
class Claim:
    """A request's hold on its key: ``replay`` is the first answer when this is a retry;
    otherwise the request runs and then ``keep``s its answer or ``release``s the key."""

    store: AnswerStore
    tenant_id: int
    scope: str
    fingerprint: str
    replay: Stored | None

    async def keep(self, status: int, headers: list[tuple[str, str]], body: bytes) -> bool:
        """Keep the answer for the key's retries. False when it is not kept and the key is
        released, so a retry computes again: an answer that did nothing a retry must not do
        again (not a 2xx), one larger than ``answer_bytes``, or one that would take its
        tenant's kept answers past ``tenant_bytes``."""
        if status in STORED_STATUSES and len(body) <= self.store.answer_bytes:
            record = _Record(self.fingerprint, status, headers, body)
            return await self.store.complete(self.tenant_id, self.scope, record)
        await self.release()
        return False

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
    replay = await store.claim(tenant_id, scope, fingerprint, key)
    return Claim(store, tenant_id, scope, fingerprint, replay)
