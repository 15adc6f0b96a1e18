"""Each tenant's text-generation budgets: concurrent streams, and prompt plus generated tokens
per minute (a bucket that may go into debt: a stream is admitted while the bucket has tokens,
and what it generated is charged when it ends).

``LocalStreamBudget`` keeps them in process (the embedded default, one gateway process).
``RedisStreamBudget`` keeps them in Redis, updated atomically by Lua scripts, so every gateway
process shares one budget per tenant: a stream holds a slot in a sorted set scored by its lease
expiry, renewed while it runs, so the slot of a process that died frees itself. Its calls go
through the process's circuit of that Redis (``tenants.ratelimit.redis_circuit``): while Redis
is down or stalled, streams start and end in process without waiting on it.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from dataclasses import dataclass, field

from .keys import KeyIdentity
from .ratelimit import RedisUnavailable, redis_circuit, redis_client

SLOT_TTL_S = 60  # a running stream renews its slot well before this (``RENEW_S``)
RENEW_S = 20


class BudgetExceeded(Exception):
    def __init__(self, message: str, wait_s: float):
        super().__init__(message)
        self.wait_s = wait_s


def too_many_streams(identity: KeyIdentity) -> BudgetExceeded:
    return BudgetExceeded(
        f"too many concurrent streams for tenant {identity.tenant_slug!r} "
        f"(at most {identity.max_streams})",
        1.0,
    )


def out_of_tokens(identity: KeyIdentity, wait_s: float) -> BudgetExceeded:
    return BudgetExceeded(
        f"token budget exceeded for tenant {identity.tenant_slug!r} "
        f"({identity.tokens_per_minute} tokens per minute)",
        wait_s,
    )


@dataclass
class TokenBudget:
    per_minute: int
    tokens: float = -1.0
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = float(self.per_minute)

    def refill(self, now: float) -> None:
        rate = self.per_minute / 60.0
        self.tokens = min(self.per_minute, self.tokens + (now - self.updated) * rate)
        self.updated = now


class LocalStreamBudget:
    """In-process budgets, one per tenant."""

    def __init__(self) -> None:
        self.active: dict[int, int] = {}
        self._budgets: dict[int, TokenBudget] = {}
        self._slots = itertools.count(1)

    async def admit(self, identity: KeyIdentity, prompt_tokens: int) -> str:
        """Take a stream slot and charge the prompt; returns the slot, or raises."""
        tenant = identity.tenant_id
        if self.active.get(tenant, 0) >= identity.max_streams:
            raise too_many_streams(identity)
        budget = self._budget(identity)
        budget.refill(time.monotonic())
        if budget.tokens < 1:
            raise out_of_tokens(identity, (1 - budget.tokens) / (identity.tokens_per_minute / 60))
        budget.tokens -= prompt_tokens
        self.active[tenant] = self.active.get(tenant, 0) + 1
        return str(next(self._slots))

    async def renew(self, identity: KeyIdentity, slot: str) -> None:
        """Nothing to renew in process: slots die with it."""

    async def finish(self, identity: KeyIdentity, slot: str, output_tokens: int) -> None:
        """Charge what the stream generated and give its slot back."""
        self._budget(identity).tokens -= output_tokens
        self.active[identity.tenant_id] = max(0, self.active.get(identity.tenant_id, 1) - 1)

    def _budget(self, identity: KeyIdentity) -> TokenBudget:
        budget = self._budgets.get(identity.tenant_id)
        if budget is None or budget.per_minute != identity.tokens_per_minute:
            budget = self._budgets[identity.tenant_id] = TokenBudget(identity.tokens_per_minute)
        return budget


# Shared by the scripts: refill the bucket in KEYS[2] at per_minute/60 a second (Redis's clock).
_REFILL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local per_minute = tonumber(ARGV[1])
local state = redis.call('HMGET', KEYS[2], 'tokens', 'ts')
local tokens = tonumber(state[1]) or per_minute
local ts = tonumber(state[2]) or now
tokens = math.min(per_minute, tokens + math.max(0, now - ts) * per_minute / 60)
"""
_SAVE = """
redis.call('HSET', KEYS[2], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[2], 120000)
"""
# ARGV: per_minute, max_streams, prompt tokens, slot, ttl s. Returns {0} admitted, {1} too many
# streams, {2, ms} out of tokens for that long.
_ADMIT = (
    _REFILL
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return {1, 0} end
if tokens < 1 then return {2, math.ceil((1 - tokens) / per_minute * 60000)} end
tokens = tokens - tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), ARGV[4])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]) * 1000)
"""
    + _SAVE
    + "return {0, 0}"
)
# ARGV: per_minute, output tokens, slot.
_FINISH = (
    _REFILL
    + """
redis.call('ZREM', KEYS[1], ARGV[3])
tokens = tokens - tonumber(ARGV[2])
"""
    + _SAVE
    + "return 0"
)
# ARGV: slot, ttl s.
_RENEW = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], 'XX', tonumber(t[1]) + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 1000)
return 0
"""


class RedisStreamBudget:
    """Budgets in Redis, shared by every gateway process: one round trip per stream start,
    one per end, one per ``RENEW_S`` of a long stream; none per token.

    While Redis is unreachable, streams are admitted against this process's own budget
    (``LocalStreamBudget``) and end there; a stream admitted in Redis whose renewal or end
    cannot reach it frees its slot by the slot's lease expiry."""

    def __init__(self, redis_url: str, prefix: str = "sy:gen:", ttl_s: int = SLOT_TTL_S):
        self._redis = redis_client(redis_url)
        self._circuit = redis_circuit(redis_url)
        self._local = LocalStreamBudget()
        self._local_slots: set[str] = set()
        self._admit = self._redis.register_script(_ADMIT)
        self._finish = self._redis.register_script(_FINISH)
        self._renew = self._redis.register_script(_RENEW)
        self._prefix = prefix
        self._ttl = ttl_s
        self._process = uuid.uuid4().hex[:8]
        self._slots = itertools.count(1)

    def _keys(self, identity: KeyIdentity) -> list[str]:
        tenant = identity.tenant_id
        return [f"{self._prefix}{tenant}:streams", f"{self._prefix}{tenant}:tokens"]

    async def admit(self, identity: KeyIdentity, prompt_tokens: int) -> str:
        slot = f"{self._process}:{next(self._slots)}"
        args: list[int | str] = [
            identity.tokens_per_minute,
            identity.max_streams,
            prompt_tokens,
            slot,
            self._ttl,
        ]
        try:
            code, wait_ms = await self._circuit.call(
                self._admit, keys=self._keys(identity), args=args
            )
        except RedisUnavailable:
            return await self._admit_locally(identity, prompt_tokens)
        if code == 1:
            raise too_many_streams(identity)
        if code == 2:
            raise out_of_tokens(identity, int(wait_ms) / 1000)
        return slot

    async def _admit_locally(self, identity: KeyIdentity, prompt_tokens: int) -> str:
        slot = f"local:{await self._local.admit(identity, prompt_tokens)}"
        self._local_slots.add(slot)
        return slot

    async def renew(self, identity: KeyIdentity, slot: str) -> None:
        if slot in self._local_slots:
            return  # a local slot needs no renewal
        with contextlib.suppress(RedisUnavailable):  # a Redis slot lives on its lease meanwhile
            await self._circuit.call(
                self._renew, keys=self._keys(identity)[:1], args=[slot, self._ttl]
            )

    async def finish(self, identity: KeyIdentity, slot: str, output_tokens: int) -> None:
        if slot in self._local_slots:
            self._local_slots.discard(slot)
            await self._local.finish(identity, slot, output_tokens)
            return
        args: list[int | str] = [identity.tokens_per_minute, output_tokens, slot]
        with contextlib.suppress(RedisUnavailable):  # its slot frees itself when its lease ends
            await self._circuit.call(self._finish, keys=self._keys(identity), args=args)

    async def close(self) -> None:
        await self._redis.aclose()


StreamBudget = LocalStreamBudget | RedisStreamBudget
