import asyncio
import time
import uuid

import pytest

from tenants.keys import KeyIdentity
from tenants.ratelimit import (
    REDIS_RETRY_S,
    REDIS_TIMEOUT_S,
    LocalLimiter,
    RedisLeaseLimiter,
    TokenBucket,
    redis_client,
    retry_after_header,
)
from tenants.stream_budget import BudgetExceeded, RedisStreamBudget
from tests.conftest import redis_url


def test_bucket_allows_burst_then_refuses_then_refills():
    bucket = TokenBucket(rate=10, burst=3, updated=0.0)
    assert [bucket.take(0.0)[0] for _ in range(4)] == [1, 1, 1, 0]
    granted, wait = bucket.take(0.0)
    assert granted == 0 and wait == pytest.approx(0.1)
    assert bucket.take(0.1)[0] == 1  # one token back after 1/rate seconds


def test_bucket_never_exceeds_burst_after_idle():
    bucket = TokenBucket(rate=100, burst=5, updated=0.0)
    assert bucket.take(1000.0, n=50)[0] == 5


def test_retry_after_is_a_whole_positive_number_of_seconds():
    assert retry_after_header(0.01) == "1"
    assert retry_after_header(2.2) == "3"


def test_local_limiter_keeps_one_bucket_per_tenant():
    limiter = LocalLimiter()

    async def run():
        a = [await limiter.acquire(1, 1.0, 2) for _ in range(3)]
        b = await limiter.acquire(2, 1.0, 2)
        return a, b

    a, b = asyncio.run(run())
    assert a[:2] == [None, None] and a[2] is not None and b is None


needs_redis = pytest.mark.skipif(redis_url() is None, reason="REDIS_URL not set")


@needs_redis
def test_two_processes_share_one_redis_budget():
    """Two limiters (as in two gateway processes) together admit about the burst, no more."""
    prefix = f"test:{uuid.uuid4().hex}:"

    async def run():
        one = RedisLeaseLimiter(redis_url(), lease_fraction=0.1, prefix=prefix)
        two = RedisLeaseLimiter(redis_url(), lease_fraction=0.1, prefix=prefix)
        admitted = 0
        for i in range(300):
            limiter = one if i % 2 else two
            if await limiter.acquire(7, 0.001, 100) is None:
                admitted += 1
        await one.close()
        await two.close()
        return admitted

    assert asyncio.run(run()) == 100


@needs_redis
def test_redis_bucket_refuses_with_retry_after_then_refills():
    prefix = f"test:{uuid.uuid4().hex}:"

    async def run():
        limiter = RedisLeaseLimiter(redis_url(), lease_fraction=0.5, prefix=prefix)
        results = [await limiter.acquire(1, 20.0, 4) for _ in range(5)]
        await asyncio.sleep(0.2)  # 20/s refills 4 tokens in 0.2 s
        after = await limiter.acquire(1, 20.0, 4)
        await limiter.close()
        return results, after

    results, after = asyncio.run(run())
    assert results[:4] == [None] * 4
    assert results[4] is not None and 0 < results[4] <= 0.06
    assert after is None


@needs_redis
def test_concurrent_requests_in_one_process_refill_the_lease_once():
    prefix = f"test:{uuid.uuid4().hex}:"

    async def run():
        limiter = RedisLeaseLimiter(redis_url(), lease_fraction=0.5, prefix=prefix)
        results = await asyncio.gather(*(limiter.acquire(3, 0.001, 10) for _ in range(30)))
        await limiter.close()
        return results

    assert sum(r is None for r in asyncio.run(run())) == 10


# Redis failing: a process falls back to its own buckets, never an error ----------------------


def test_with_redis_down_the_limiter_keeps_admitting_from_its_own_buckets(own_redis):
    async def run():
        limiter = RedisLeaseLimiter(own_redis.url, lease_fraction=0.5, prefix="t:")
        shared = await limiter.acquire(1, 1.0, 4)
        own_redis.stop()
        started = time.monotonic()
        down = [await limiter.acquire(2, 1.0, 2) for _ in range(3)]
        elapsed = time.monotonic() - started
        await limiter.close()
        return shared, down, elapsed

    shared, down, elapsed = asyncio.run(run())
    assert shared is None
    # Tenant 2's own quota in process: its burst of 2, then a wait; no error, no hang.
    assert down[:2] == [None, None] and down[2] is not None
    assert elapsed < 2 * REDIS_TIMEOUT_S + 1


def test_the_shared_budget_is_used_again_once_redis_is_back(own_redis):
    async def run():
        limiter = RedisLeaseLimiter(own_redis.url, lease_fraction=0.5, prefix="t:")
        own_redis.stop()
        await limiter.acquire(3, 100.0, 10)  # fails over to the local bucket
        own_redis.start()
        await asyncio.sleep(REDIS_RETRY_S + 0.1)
        await limiter.acquire(3, 100.0, 10)
        keys = await redis_client(own_redis.url).keys("t:*")
        await limiter.close()
        return keys

    assert asyncio.run(run()) == [b"t:3"]


def test_with_redis_down_streams_are_admitted_and_ended_in_process(own_redis):
    identity = KeyIdentity(1, 1, "alpha", 10.0, 20, max_streams=1, tokens_per_minute=1000)

    async def run():
        budget = RedisStreamBudget(own_redis.url, prefix=f"t:{uuid.uuid4().hex}:", ttl_s=60)
        in_redis = await budget.admit(identity, 5)
        own_redis.stop()
        await budget.renew(identity, in_redis)  # cannot reach Redis: no error
        await budget.finish(identity, in_redis, 10)
        local = await budget.admit(identity, 5)
        with pytest.raises(BudgetExceeded):  # the process's own limit of one stream
            await budget.admit(identity, 5)
        await budget.finish(identity, local, 10)
        again = await budget.admit(identity, 5)
        await budget.close()
        return in_redis, local, again

    in_redis, local, again = asyncio.run(run())
    assert not in_redis.startswith("local:") and local.startswith("local:")
    assert again.startswith("local:")
