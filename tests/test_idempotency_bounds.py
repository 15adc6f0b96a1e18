"""What inference answers kept for ``Idempotency-Key`` retries may take (gateway.idempotency): an
answer over ``answer_bytes`` is not kept, nor one past its tenant's ``tenant_bytes``, in process
and in Redis, and its key is freed for the retry; a tenant's budget frees as its answers expire.
The shipped Redis configuration (deploy/redis.conf) caps Redis's memory and evicts only keys
with a TTL: one tenant filling a Redis started with it leaves the other tenants' answers, Celery's
queue and the channel layer's messages where they were."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from asgiref.sync import async_to_sync

from gateway import idempotency
from tests.conftest import OwnRedis

SHIPPED = Path(__file__).resolve().parents[1] / "deploy" / "redis.conf"
MiB = 1024 * 1024
# Celery's queue as kombu keeps it (a list without a TTL), and a channel layer message as
# channels_redis keeps it (a sorted set per channel, with the layer's 60 s expiry).
QUEUE, QUEUED = "celery", [b'{"task": "fleet.tasks.autoscale"}', b'{"task": "batch.tasks.run"}']
CHANNEL = "asgi:specific.gateway.abc!"

Start = Callable[..., OwnRedis]


@pytest.fixture
def shipped_redis() -> Iterator[Start]:
    """Starts redis-servers with deploy/redis.conf, then the test's own options (a small
    maxmemory, so that a test can fill it)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    servers: list[OwnRedis] = []

    def start(*options: str) -> OwnRedis:
        server = OwnRedis(str(SHIPPED), *options)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def make_store(
    backend: str, start: Start, retention_s: float = 3600, **bounds: int
) -> idempotency.AnswerStore:
    local = idempotency.LocalAnswers(retention_s, 15, 64 * MiB, **bounds)
    return local if backend == "process" else idempotency.RedisAnswers(start().url, local)


async def keep(store: idempotency.AnswerStore, tenant: int, key: str, body: bytes) -> bool:
    """A first request with ``key``, answered ``body``: whether its answer was kept."""
    claim = await idempotency.claim(store, tenant, 1, key, "POST", "/p", b"request")
    assert claim is not None and claim.replay is None, f"{key} was not free"
    return await claim.keep(200, [], body)


async def replay(store: idempotency.AnswerStore, tenant: int, key: str) -> bytes | None:
    """The answer a retry with ``key`` is given; None when the retry computes."""
    claim = await idempotency.claim(store, tenant, 1, key, "POST", "/p", b"request")
    assert claim is not None
    if claim.replay is None:
        await claim.release()
        return None
    return claim.replay.body


BACKENDS = ["process", "redis"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_answer_over_the_cap_is_not_kept_and_its_retry_computes(backend, shipped_redis):
    store = make_store(backend, shipped_redis, answer_bytes=1000)

    async def scenario() -> list[object]:
        return [
            await keep(store, 1, "large", b"y" * 1001),
            await replay(store, 1, "large"),
            await keep(store, 1, "fits", b"y" * 1000),
            await replay(store, 1, "fits"),
        ]

    assert async_to_sync(scenario)() == [False, None, True, b"y" * 1000]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tenant_at_its_budget_keeps_no_more_and_other_tenants_still_do(backend, shipped_redis):
    # 2,000 bytes and the key and record around them: four fit in 10,000, a fifth does not.
    store = make_store(backend, shipped_redis, tenant_bytes=10_000)
    body = b"y" * 2000

    async def scenario() -> tuple[list[bool], list[bytes | None], bool, bytes | None]:
        kept = [await keep(store, 1, f"a{n}", body) for n in range(6)]
        replays = [await replay(store, 1, f"a{n}") for n in (0, 3, 4)]
        return kept, replays, await keep(store, 2, "a0", body), await replay(store, 2, "a0")

    kept, replays, other_kept, other_replay = async_to_sync(scenario)()
    assert kept == [True] * 4 + [False] * 2
    assert replays == [body, body, None]  # the fifth's key was freed: its retry computes
    assert other_kept and other_replay == body


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tenants_budget_frees_as_its_answers_expire(backend, shipped_redis):
    # Redis counts an answer until its bucket ends: at most a 16th of the retention past it.
    store = make_store(backend, shipped_redis, retention_s=1.6, tenant_bytes=5000)
    body = b"y" * 2000

    async def scenario() -> tuple[list[bool], bool]:
        full = [await keep(store, 1, f"a{n}", body) for n in range(3)]
        await asyncio.sleep(1.6 + 1.6 / idempotency.BUDGET_BUCKETS + 0.1)
        return full, await keep(store, 1, "later", body)

    assert async_to_sync(scenario)() == ([True, True, False], True)


def test_the_shipped_redis_config_caps_memory_and_evicts_only_keys_with_a_ttl(shipped_redis):
    config = redis.Redis.from_url(shipped_redis().url).config_get("maxmemory*")
    assert int(config["maxmemory"]) == 1024 * MiB
    assert config["maxmemory-policy"] == "volatile-lru"


def test_one_tenant_filling_redis_leaves_the_other_tenants_alone(shipped_redis):
    """Tenant 1 sends 40 MiB of answers at a Redis of 32 MiB (the shipped policy): its budget
    of 8 MiB keeps 15 of them and Redis never has to evict anything."""
    server = shipped_redis("--maxmemory", "32mb")
    client = redis.Redis.from_url(server.url)
    client.rpush(QUEUE, *QUEUED)
    client.zadd(CHANNEL, {b"a message": 1.0})
    client.expire(CHANNEL, 60)
    local = idempotency.LocalAnswers(86400, 15, 64 * MiB, answer_bytes=MiB, tenant_bytes=8 * MiB)
    store = idempotency.RedisAnswers(server.url, local)
    answer = b"y" * (MiB // 2)

    async def scenario() -> tuple[list[bool], list[bool], list[bytes | None]]:
        before = await keep(store, 2, "before", b"first")
        flood = [await keep(store, 1, f"a{n}", answer) for n in range(80)]
        after = await keep(store, 2, "after", b"second")
        replays = [await replay(store, 2, key) for key in ("before", "after")]
        return flood, [before, after], replays

    flood, others_kept, others_replayed = async_to_sync(scenario)()
    # 8 MiB holds 15 answers of 512 KiB and their keys, not 16.
    assert flood == [True] * 15 + [False] * 65
    assert others_kept == [True, True] and others_replayed == [b"first", b"second"]
    assert local.size == 0  # all of it was Redis's, none the fallback's
    # Tenant 1's byte count is one small hash, gone once its last answer has expired.
    budget = idempotency.BUDGET_PREFIX + "1"
    assert 0 < client.pttl(budget) <= 86400_000 * (1 + 1 / idempotency.BUDGET_BUCKETS)
    assert client.hlen(budget) == 1
    info = client.info()
    assert info["evicted_keys"] == 0 and info["used_memory"] < 32 * MiB
    assert client.lrange(QUEUE, 0, -1) == QUEUED
    assert client.zcard(CHANNEL) == 1


def test_past_maxmemory_redis_evicts_idle_answers_and_never_the_queue(shipped_redis):
    """The backstop, should the budgets add up to more than maxmemory: the shipped policy makes
    room by evicting the least recently used keys that have a TTL (the idle answers). Celery's
    queue has none: idle longest of all, it stays (allkeys-lru would evict it first); a fresh
    channel message or answer is not the least recently used (volatile-ttl would evict the
    message first: its TTL is the shortest)."""
    server = shipped_redis("--maxmemory", "16mb")
    client = redis.Redis.from_url(server.url)
    local = idempotency.LocalAnswers(86400, 15, 64 * MiB, answer_bytes=MiB)  # no tenant budget
    store = idempotency.RedisAnswers(server.url, local)
    answer = b"y" * (MiB // 2)

    async def scenario() -> tuple[list[bool], bytes | None]:
        client.rpush(QUEUE, *QUEUED)
        await asyncio.sleep(1.5)  # Redis's LRU clock counts whole seconds
        old = [await keep(store, 1, f"old{n}", answer) for n in range(24)]
        await asyncio.sleep(1.5)
        client.zadd(CHANNEL, {b"a message": 1.0})
        client.expire(CHANNEL, 60)
        other = await keep(store, 2, "fresh", b"answer")
        new = [await keep(store, 1, f"new{n}", answer) for n in range(10)]
        return [*old, other, *new], await replay(store, 2, "fresh")

    kept, fresh = async_to_sync(scenario)()
    assert all(kept) and local.size == 0  # Redis made room: no write was refused
    assert client.info()["evicted_keys"] > 0
    assert client.lrange(QUEUE, 0, -1) == QUEUED
    assert client.zcard(CHANNEL) == 1 and fresh == b"answer"
