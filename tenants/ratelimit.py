"""Token-bucket rate limiting per tenant.

``LocalLimiter`` keeps buckets in process (the embedded default: one gateway process).
``RedisLeaseLimiter`` keeps one bucket per tenant in Redis, updated atomically by a Lua script,
so several gateway processes share one budget. To keep Redis off the warm path, a process takes
tokens in bulk (a lease of a share of the burst) and spends them locally: one round trip per
lease instead of one per request. Leased tokens not spent within ``LEASE_TTL_S`` are dropped,
so an idle process cannot hoard budget for long.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

LEASE_TTL_S = 1.0


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
    """Buckets in Redis shared by every gateway process, spent locally in leases."""

    def __init__(self, redis_url: str, lease_fraction: float = 0.1, prefix: str = "sy:rl:"):
        from redis import asyncio as aioredis

        self._redis = aioredis.Redis.from_url(redis_url)
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
        # One coroutine refills; others waiting on the lock then spend from the new lease.
        async with lease.lock:
            if self._spend(lease):
                return None
            granted, wait_ms = await self._script(
                keys=[f"{self._prefix}{tenant_id}"], args=[rate, burst, self.lease_size(burst)]
            )
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
