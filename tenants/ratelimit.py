"""Token-bucket rate limiting per tenant.

``LocalLimiter`` keeps buckets in process (the embedded default: one gateway process).
``RedisLeaseLimiter`` keeps one bucket per tenant in Redis, updated atomically by a Lua script,
so several gateway processes share one budget. To keep Redis off the warm path, a process takes
tokens in bulk (a lease of a share of the burst) and spends them locally: one round trip per
lease instead of one per request. Leased tokens not spent within ``LEASE_TTL_S`` are dropped,
so an idle process cannot hoard budget for long.

Redis failing must not fail requests: ``RedisCircuit`` sends a process to its own in-process
buckets while Redis is unreachable and tries Redis again a second later.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

LEASE_TTL_S = 1.0
# A Redis that does not answer within this long counts as down (the call is on a request path).
REDIS_TIMEOUT_S = 0.5
# After a failure, Redis is tried again this long later; meanwhile the process uses its own.
REDIS_RETRY_S = 1.0
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisCircuit:
    """Whether to call Redis now. After a failed call the process uses its in-process fallback
    for ``REDIS_RETRY_S`` before trying Redis again: during an outage a request costs neither
    an error nor a connect timeout, and each process spends one failed call a second."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._retry_at = 0.0
        self._down = False

    @property
    def closed(self) -> bool:
        """Redis may be called (no failure in the last ``REDIS_RETRY_S``)."""
        return time.monotonic() >= self._retry_at

    def failed(self, exc: BaseException) -> None:
        if not self._down:
            log.warning(
                "%s: Redis is unreachable (%r); this process's own budget serves", self.what, exc
            )
        self._down = True
        self._retry_at = time.monotonic() + REDIS_RETRY_S

    def succeeded(self) -> None:
        if self._down:
            log.info("%s: Redis answers again; the shared budget serves", self.what)
        self._down = False


def redis_client(redis_url: str) -> aioredis.Redis:
    """A client whose calls fail within ``REDIS_TIMEOUT_S`` when Redis is down or stalled."""
    return aioredis.Redis.from_url(
        redis_url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
    )


@dataclass
class TokenBucket:
    """A bucket of ``burst`` tokens refilled continuously at ``rate`` per second."""

    rate: float
    burst: int
    tokens: float = -1.0
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = float(self.burst)

    def take(self, now: float, n: int = 1) -> tuple[int, float]:
        """Take up to ``n`` tokens: (granted, seconds until one token is available if none)."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        granted = min(n, int(self.tokens))
        if granted == 0:
            return 0, (1.0 - self.tokens) / self.rate
        self.tokens -= granted
        return granted, 0.0


class LocalLimiter:
    """In-process buckets, one per tenant."""

    def __init__(self) -> None:
        self._buckets: dict[int, TokenBucket] = {}

    async def acquire(self, tenant_id: int, rate: float, burst: int) -> float | None:
        """None when the request may pass, else the seconds to wait (for ``Retry-After``)."""
        bucket = self._buckets.get(tenant_id)
        if bucket is None or bucket.rate != rate or bucket.burst != burst:
            bucket = self._buckets[tenant_id] = TokenBucket(rate, burst)
        granted, wait = bucket.take(time.monotonic())
        return None if granted else wait


# KEYS[1] = bucket key; ARGV = rate, burst, tokens wanted. Redis's own clock keeps all gateway
# processes consistent. Returns {granted, milliseconds until a token is available}.
_TAKE_SCRIPT = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local granted = math.min(want, math.floor(tokens))
local wait_ms = 0
if granted == 0 then wait_ms = math.ceil((1 - tokens) / rate * 1000) end
tokens = tokens - granted
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {granted, wait_ms}
"""


@dataclass
class _Lease:
    tokens: int = 0
    expires: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RedisLeaseLimiter:
    """Buckets in Redis shared by every gateway process, spent locally in leases; this
    process's own buckets while Redis is unreachable (each process then grants a tenant its
    whole quota: a looser limit for a few seconds beats refusing every request)."""

    def __init__(self, redis_url: str, lease_fraction: float = 0.1, prefix: str = "sy:rl:"):
        self._redis = redis_client(redis_url)
        self._circuit = RedisCircuit("rate limiter")
        self._local = LocalLimiter()
        self._script = self._redis.register_script(_TAKE_SCRIPT)
        self._fraction = lease_fraction
        self._prefix = prefix
        self._leases: dict[int, _Lease] = {}

    def lease_size(self, burst: int) -> int:
        return max(1, math.floor(burst * self._fraction))

    async def acquire(self, tenant_id: int, rate: float, burst: int) -> float | None:
        lease = self._leases.get(tenant_id)
        if lease is None:
            lease = self._leases[tenant_id] = _Lease()
        if self._spend(lease):
            return None
        if not self._circuit.closed:
            return await self._local.acquire(tenant_id, rate, burst)
        # One coroutine refills; others waiting on the lock then spend from the new lease.
        async with lease.lock:
            if self._spend(lease):
                return None
            try:
                granted, wait_ms = await self._script(
                    keys=[f"{self._prefix}{tenant_id}"], args=[rate, burst, self.lease_size(burst)]
                )
            except REDIS_ERRORS as exc:
                self._circuit.failed(exc)
                return await self._local.acquire(tenant_id, rate, burst)
            self._circuit.succeeded()
            if not granted:
                return max(wait_ms / 1000.0, 0.001)
            lease.tokens = int(granted) - 1
            lease.expires = time.monotonic() + LEASE_TTL_S
            return None

    @staticmethod
    def _spend(lease: _Lease) -> bool:
        if lease.tokens > 0 and time.monotonic() < lease.expires:
            lease.tokens -= 1
            return True
        return False

    async def close(self) -> None:
        await self._redis.aclose()


def retry_after_header(wait_s: float) -> str:
    """``Retry-After`` takes whole seconds; never advertise 0."""
    return str(max(1, math.ceil(wait_s)))


class InFlightLimit:
    """Requests of each API key in flight at once in this process (``ApiKey.max_in_flight``).

    Counted in process, not in Redis: a count must go down again when a request ends however it
    ends, and a process that dies would leave its share counted in Redis. With N gateway
    processes a key may so have up to N times its limit in flight in all.
    """

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], int] = {}

    def enter(self, key: tuple[int, int], limit: int) -> bool:
        """Count one more request of ``key`` (tenant id, key id: a web session's requests count
        as its tenant's key 0), or False (counting nothing) when it has
        ``limit`` in flight already."""
        held = self.counts.get(key, 0)
        if held >= limit:
            return False
        self.counts[key] = held + 1
        return True

    def leave(self, key: tuple[int, int]) -> None:
        held = self.counts.get(key, 0) - 1
        if held > 0:
            self.counts[key] = held
        else:
            self.counts.pop(key, None)  # idle keys leave no entry behind
