"""Token-bucket rate limiting per tenant.

``LocalLimiter`` keeps buckets in process (the embedded default: one gateway process).
``RedisLeaseLimiter`` keeps one bucket per tenant in Redis, updated atomically by a Lua script,
so several gateway processes share one budget. To keep Redis off the warm path, a process takes
tokens in bulk (a lease of a share of the burst) and spends them locally: one round trip per
lease instead of one per request. Leased tokens not spent within ``LEASE_TTL_S`` are dropped,
so an idle process cannot hoard budget for long.

Redis failing must not fail requests: ``RedisCircuit`` sends a process to its own in-process
buckets while Redis is unreachable or stalled and tries Redis again a second later. The circuit
is the process's, per Redis server, shared with the stream budgets and the channel layer: the
first call that times out opens it for all of them, and the calls waiting on Redis with it give
up at once, so a stalled Redis costs a process one ``REDIS_TIMEOUT_S`` per ``REDIS_RETRY_S``,
however many requests arrive meanwhile.
"""

from __future__ import annotations

import asyncio
import math
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar
from urllib.parse import urlsplit

from redis import asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from platform_site.breakers import SharedBreaker

P = ParamSpec("P")
T = TypeVar("T")

LEASE_TTL_S = 1.0
# A Redis that does not answer within this long counts as down (the call is on a request path).
REDIS_TIMEOUT_S = 0.5
# After a failure, Redis is tried again this long later; meanwhile the process uses its own.
REDIS_RETRY_S = 1.0
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisUnavailable(RedisConnectionError):
    """Redis was not called (its circuit is open, or another call is probing it) or did not
    answer in time: take the fallback. A ``RedisConnectionError``, so code that handles
    ``REDIS_ERRORS`` handles it too."""


class RedisCircuit:
    """Whether to call Redis now. After a failed call the process uses its in-process fallback
    for ``REDIS_RETRY_S``; then one call probes Redis while the others keep to the fallback
    until it answers. During an outage a request costs neither an error nor a timeout, and the
    process spends at most one ``REDIS_TIMEOUT_S`` per ``REDIS_RETRY_S`` waiting on Redis.

    ``redis_circuit(url)`` is the one circuit of a server, shared by every user in the process:
    one call timing out (a stalled server) opens it for all of them, and ``call`` sends the
    calls waiting on that server at that moment to their fallback at once, instead of letting
    each time out in turn (50 requests of one tenant queued 25 s behind its lease lock).
    ``RedisCircuit(what)`` is a circuit of its own, for a user that reports through ``closed``,
    ``failed`` and ``succeeded`` rather than ``call``."""

    def __init__(self, what: str) -> None:
        self._breaker = SharedBreaker(f"Redis ({what})", REDIS_RETRY_S)
        # One future per call waiting on Redis, each on its own event loop; set when it opens.
        self._waiting: set[asyncio.Future[None]] = set()

    @property
    def closed(self) -> bool:
        """Redis may be called (no failure in the last ``REDIS_RETRY_S``, no probe out)."""
        return self._breaker.available()

    def failed(self, exc: BaseException) -> None:
        self._breaker.failed(exc)
        for waiting in list(self._waiting):  # a copy: calls of other threads come and go
            waiting.get_loop().call_soon_threadsafe(_settle, waiting)

    def succeeded(self) -> None:
        self._breaker.succeeded()

    async def call(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """``await fn(*args, **kwargs)``, a call to Redis, or ``RedisUnavailable`` when the
        caller must take its fallback: at once while the circuit is open, within
        ``REDIS_TIMEOUT_S`` when Redis does not answer, and as soon as another call finds it
        failing. An error Redis answers with (a script's) is an answer: it is raised as is."""
        if not self._breaker.claim():
            raise RedisUnavailable("Redis is not called while its circuit is open")
        opened = asyncio.get_running_loop().create_future()
        self._waiting.add(opened)
        task = asyncio.ensure_future(fn(*args, **kwargs))
        try:
            await asyncio.wait((task, opened), timeout=REDIS_TIMEOUT_S, return_when=FIRST_COMPLETED)
        finally:
            self._waiting.discard(opened)
            if not task.done():
                task.cancel()  # redis-py drops the connection of a cancelled command
        if task.done():
            failure = task.exception()
        elif opened.done():
            raise RedisUnavailable("another call found Redis failing")
        else:  # a bound of its own: the channel layer's connections have no socket timeout
            failure = RedisTimeoutError(f"Redis did not answer within {REDIS_TIMEOUT_S} s")
        if isinstance(failure, REDIS_ERRORS):
            self.failed(failure)
            raise RedisUnavailable(str(failure)) from failure
        self.succeeded()  # Redis answered (an error it answered with is an answer too)
        return task.result()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_circuits: dict[str, RedisCircuit] = {}


def redis_circuit(redis_url: str) -> RedisCircuit:
    """The circuit of the Redis server at ``redis_url``, one per process."""
    circuit = _circuits.get(redis_url)
    if circuit is None:
        # setdefault: two threads asking at once still share one.
        circuit = _circuits.setdefault(redis_url, RedisCircuit(_where(redis_url)))
    return circuit


def _where(redis_url: str) -> str:
    """host:port of a Redis URL, for the log (never its password)."""
    parsed = urlsplit(redis_url)
    return f"{parsed.hostname}:{parsed.port or 6379}" if parsed.hostname else parsed.path


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
        self._circuit = redis_circuit(redis_url)
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
        # One coroutine refills; others waiting on the lock then spend from the new lease, or
        # (the refill having opened the circuit) go to the local bucket without calling Redis.
        async with lease.lock:
            if self._spend(lease):
                return None
            try:
                granted, wait_ms = await self._circuit.call(
                    self._script,
                    keys=[f"{self._prefix}{tenant_id}"],
                    args=[rate, burst, self.lease_size(burst)],
                )
            except RedisUnavailable:
                return await self._local.acquire(tenant_id, rate, burst)
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
