"""A stalled Redis (SIGSTOP: it accepts connections and never answers) costs each process one
timeout per retry interval, not one per request: the first call that times out opens the
process's circuit of that server for the rate limiter, the stream budgets and the channel layer
alike, the calls waiting on it with that one take their fallback at once, and after the
interval a single call probes. The Redis is the test's own (``own_redis``), never the shared
one."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from contextlib import contextmanager

import pytest

from gateway.channel_layer import FailSoftRedisChannelLayer
from tenants.keys import KeyIdentity
from tenants.ratelimit import (
    REDIS_ERRORS,
    REDIS_RETRY_S,
    REDIS_TIMEOUT_S,
    RedisLeaseLimiter,
    redis_circuit,
    redis_client,
)
from tenants.stream_budget import RedisStreamBudget

N = 50
# About one timeout (with room for a loaded 2-core box); before the shared circuit, N requests
# of one tenant took N timeouts (25 s), one after another behind the tenant's lease lock.
ONE_TIMEOUT_S = REDIS_TIMEOUT_S + 1.0


@contextmanager
def stalled(server):
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def identity(tenant_id: int) -> KeyIdentity:
    return KeyIdentity(1, tenant_id, "alpha", 10.0, 20, max_streams=N, tokens_per_minute=10**6)


async def timed(calls):
    started = time.monotonic()
    results = await asyncio.gather(*calls, return_exceptions=True)
    return results, time.monotonic() - started


async def evalsha_calls(url: str) -> int:
    client = redis_client(url)
    stats = await client.info("commandstats")
    await client.aclose()
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_concurrent_requests_with_redis_stalled_wait_one_timeout_then_one_probe(own_redis):
    prefix = f"t:{uuid.uuid4().hex}:"

    async def run():
        limiter = RedisLeaseLimiter(own_redis.url, lease_fraction=0.1, prefix=prefix)
        budget = RedisStreamBudget(own_redis.url, prefix=prefix)
        assert await limiter.acquire(1, 1.0, 20) is None  # connected, script loaded
        with stalled(own_redis):
            # One tenant's burst: every request after the first waited on the lease lock.
            one_tenant, one_tenant_s = await timed(limiter.acquire(2, 1.0, 20) for _ in range(N))
            await asyncio.sleep(REDIS_RETRY_S)  # half-open again: one probe, which stalls too
            streams, streams_s = await timed(budget.admit(identity(3), 5) for _ in range(N))
        # Redis answers again: one call probes it, the others keep to their fallback meanwhile.
        # On a loaded machine the first probe (a new connection to a server just resumed) may
        # itself outlast the timeout and open the circuit again: each interval probes once.
        for _ in range(5):
            await asyncio.sleep(REDIS_RETRY_S)
            before = await evalsha_calls(own_redis.url)
            probe, _ = await timed(limiter.acquire(100 + i, 1.0, 20) for i in range(N))
            probed = await evalsha_calls(own_redis.url) - before
            if redis_circuit(own_redis.url).closed or probed != 1:
                break
        before = await evalsha_calls(own_redis.url)
        after, _ = await timed(limiter.acquire(200 + i, 1.0, 20) for i in range(N))
        closed = await evalsha_calls(own_redis.url) - before
        await limiter.close()
        await budget.close()
        return one_tenant, one_tenant_s, streams, streams_s, probe, probed, after, closed

    one_tenant, one_tenant_s, streams, streams_s, probe, probed, after, closed = asyncio.run(run())
    print(f"{N} requests of one tenant: {one_tenant_s:.2f} s; {N} stream starts: {streams_s:.2f} s")
    # Every request took the fallback, this process's own bucket: its burst of 20 admitted
    # (None), the rest told to wait; no error, and about one timeout for all of them.
    assert one_tenant.count(None) == 20
    assert all(isinstance(r, float) for r in one_tenant if r is not None)
    assert REDIS_TIMEOUT_S * 0.9 <= one_tenant_s < ONE_TIMEOUT_S
    assert all(isinstance(s, str) and s.startswith("local:") for s in streams), streams
    assert streams_s < ONE_TIMEOUT_S
    assert probe == [None] * N and after == [None] * N
    assert probed == 1  # one probe while half-open...
    assert closed == N  # ...and once it answered, every call goes to Redis again


def test_the_circuit_is_one_per_server_and_process():
    url = "redis://127.0.0.1:6390/0"
    assert redis_circuit(url) is redis_circuit(url)
    assert redis_circuit(url) is not redis_circuit("redis://127.0.0.1:6391/0")


def test_a_timeout_in_one_user_sends_the_others_to_their_fallback(own_redis):
    """The rate limiter, the stream budgets and the channel layer share the circuit."""

    async def run():
        limiter = RedisLeaseLimiter(own_redis.url, prefix=f"t:{uuid.uuid4().hex}:")
        budget = RedisStreamBudget(own_redis.url, prefix=f"t:{uuid.uuid4().hex}:")
        layer = FailSoftRedisChannelLayer(hosts=[{"address": own_redis.url}])
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "warm"})
        with stalled(own_redis):
            sends = [layer.send(channel, {"type": "stalled"}) for _ in range(N)]
            results, elapsed = await timed(
                [limiter.acquire(1, 1.0, 20), budget.admit(identity(1), 5), *sends]
            )
            started = time.monotonic()
            with pytest.raises(REDIS_ERRORS):  # open: raises without waiting
                await layer.send(channel, {"type": "open"})
            open_s = time.monotonic() - started
        await limiter.close()
        await budget.close()
        await layer.close_pools()
        return results, elapsed, open_s

    results, elapsed, open_s = asyncio.run(run())
    admitted, slot, *sends = results
    assert admitted is None and slot.startswith("local:")
    assert all(isinstance(r, REDIS_ERRORS) for r in sends)
    assert elapsed < ONE_TIMEOUT_S and open_s < 0.1
