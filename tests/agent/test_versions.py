"""The set of loaded versions alone: an in-memory artifact cache on one side, a sink that keeps
the status reports on the other."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from serving_agent import Batcher, ChecksumMismatch, FunctionRuntime, NotLoaded
from serving_agent._memory import MiB
from serving_agent._versions import Loaded, VersionSet, VersionUsage
from serving_agent.protocol import ARTIFACT_PATH, Assign, VersionSpec, VersionStatus

if TYPE_CHECKING:
    from tests.agent.conftest import TinyModel

pytestmark = pytest.mark.anyio

PLATFORM = "http://platform.test"
HEADERS = {"Authorization": "Bearer node-token"}


class FakeCache:
    """Hands out the artifact at ``path`` for any version (or raises ``fails``), and keeps what
    it was asked for."""

    def __init__(self, path: Path, fails: Exception | None = None) -> None:
        self.path, self.fails = path, fails
        self.fetched: list[tuple[str, str, dict[str, str]]] = []

    async def fetch(self, url: str, sha256: str, headers: Mapping[str, str]) -> Path:
        self.fetched.append((url, sha256, dict(headers)))
        if self.fails is not None:
            raise self.fails
        return self.path


class Statuses:
    """A status sink that keeps every report, in order."""

    def __init__(self) -> None:
        self.reports: list[VersionStatus] = []
        self._queue: asyncio.Queue[VersionStatus] = asyncio.Queue()

    async def __call__(self, status: VersionStatus) -> None:
        self.reports.append(status)
        self._queue.put_nowait(status)

    async def expect(self, state: str, version_id: int, timeout: float = 10) -> VersionStatus:
        """The next report of ``state`` for ``version_id``, skipping any others."""
        async with asyncio.timeout(timeout):
            while True:
                status = await self._queue.get()
                if (status.state, status.version_id) == (state, version_id):
                    return status

    def states(self, version_id: int) -> list[str]:
        return [s.state for s in self.reports if s.version_id == version_id]


def make_versions(
    cache: FakeCache, budget: int = 0, cold_after_s: float = 0.0
) -> tuple[VersionSet, Statuses]:
    async def memory_budget() -> int:
        return budget

    statuses = Statuses()
    versions = VersionSet(
        cache,
        statuses,
        platform=PLATFORM,
        headers=HEADERS,
        memory_budget=memory_budget,
        cold_after_s=cold_after_s,
    )
    return versions, statuses


def held(spec: VersionSpec, footprint: int = MiB, idle_s: float = 60.0) -> Loaded:
    """A loaded doubling model that claims ``footprint`` and was last used ``idle_s`` ago."""
    runtime = FunctionRuntime(lambda inputs: [inputs["x"][:, :2] * 2], ["x"], ["y"])
    usage = VersionUsage(
        memory_bytes=footprint,
        measured_bytes=footprint,
        artifact_bytes=footprint,
        last_used=time.monotonic() - idle_s,
    )
    return Loaded(spec, runtime, Batcher(runtime, inline=True), usage)


def assign(*specs: VersionSpec) -> Assign:
    return Assign(versions=list(specs))


@pytest.fixture
def cache(tiny_model: TinyModel) -> FakeCache:
    return FakeCache(tiny_model.path)


# Loading ---------------------------------------------------------------------------------------


async def test_an_assigned_version_is_fetched_by_its_sha256_loaded_and_reported_ready(
    cache: FakeCache, tiny_model: TinyModel, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache)
    versions.apply(assign(make_spec()))
    ready = await statuses.expect("ready", 1)
    url = PLATFORM + ARTIFACT_PATH.format(version_id=1)
    assert cache.fetched == [(url, tiny_model.sha256, HEADERS)]
    assert statuses.states(1) == ["loading", "ready"]
    assert ready.provider == "CPUExecutionProvider"
    loaded = versions.loaded[1]
    assert ready.memory_bytes == loaded.usage.memory_bytes >= len(tiny_model.data)
    assert loaded.usage.load_s > 0
    y, _, _ = await loaded.batcher.infer_timed({"x": np.zeros((1, 4), np.float32)})
    assert y[0].shape == (1, 2)
    await versions.shutdown()


async def test_assigned_versions_load_smallest_first_and_generators_last(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    """After a restart every version is assigned at once: a small classifier must not wait
    behind larger models or a text generator (the issue measured 7.6 s)."""
    versions, statuses = make_versions(cache)
    specs = [
        make_spec(version_id=1, format="textgen", memory_bytes=10 * MiB),
        make_spec(version_id=2, memory_bytes=50 * MiB),
        make_spec(version_id=3, memory_bytes=1 * MiB),
    ]
    versions.apply(assign(*specs))
    await statuses.expect("ready", 2)
    loading = [s.version_id for s in statuses.reports if s.state == "loading"]
    assert loading[:2] == [3, 2], statuses.reports
    ready = [s.version_id for s in statuses.reports if s.state == "ready"]
    assert ready[:2] == [3, 2], statuses.reports
    await versions.shutdown()


@pytest.mark.parametrize(
    ("error", "detail"),
    [
        (ChecksumMismatch("sha256 mismatch: expected abc"), "sha256 mismatch: expected abc"),
        (OSError("connection refused"), "download failed: connection refused"),
    ],
)
async def test_an_artifact_that_cannot_be_fetched_fails_the_version(
    tiny_model: TinyModel,
    make_spec: Callable[..., VersionSpec],
    error: Exception,
    detail: str,
) -> None:
    versions, statuses = make_versions(FakeCache(tiny_model.path, fails=error))
    versions.apply(assign(make_spec()))
    failed = await statuses.expect("failed", 1)
    assert failed.detail == detail
    assert versions.loaded == {}
    await versions.shutdown()


async def test_a_presigned_bucket_url_is_fetched_without_the_node_token(
    cache: FakeCache, tiny_model: TinyModel, make_spec: Callable[..., VersionSpec]
) -> None:
    """With S3 storage the spec names the bucket itself: the node token must not go there."""
    bucket = "https://models.s3.example.com/artifacts/1/a.onnx?X-Amz-Signature=abc"
    versions, statuses = make_versions(cache)
    versions.apply(assign(make_spec(artifact_url=bucket)))
    await statuses.expect("ready", 1)
    assert cache.fetched == [(bucket, tiny_model.sha256, {})]


async def test_new_limits_apply_to_the_loaded_version_without_a_reload(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache)
    versions.loaded[1] = before = held(make_spec())
    versions.apply(assign(make_spec(max_batch_size=4, max_queue_delay_ms=2, max_queue=9)))
    ready = await statuses.expect("ready", 1)
    assert versions.loaded[1] is before and cache.fetched == []
    assert (ready.provider, ready.memory_bytes) == ("python", MiB)
    batcher = before.batcher
    assert (batcher.max_batch_size, batcher.max_queue_delay_ms, batcher.max_queue) == (4, 2, 9)
    await versions.shutdown()


async def test_a_version_whose_artifact_changed_is_loaded_again(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache)
    versions.loaded[1] = held(make_spec(sha256="0" * 64))
    versions.apply(assign(make_spec()))
    await statuses.expect("ready", 1)
    assert statuses.states(1) == ["loading", "ready"]  # replaced, not reported unloaded
    assert versions.loaded[1].provider == "CPUExecutionProvider"
    await versions.shutdown()


async def test_versions_left_out_of_an_assign_are_unloaded_and_refuse_requests(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache)
    versions.loaded[1] = loaded = held(make_spec())
    versions.apply(assign())
    await statuses.expect("unloaded", 1)
    assert versions.loaded == {}
    with pytest.raises(NotLoaded, match="version unloaded"):
        await loaded.batcher.infer({"x": np.zeros((1, 4), np.float32)})
    await versions.shutdown()


async def test_shutdown_unloads_everything_without_reporting_it(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache)
    versions.loaded[1] = held(make_spec())
    await versions.shutdown()
    assert versions.loaded == {} and statuses.reports == []


# Memory ----------------------------------------------------------------------------------------


async def test_the_coldest_version_is_the_least_recently_used_one_with_nothing_running(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, _ = make_versions(cache, cold_after_s=10)
    versions.loaded[1] = busy = held(make_spec(version_id=1), idle_s=300)
    versions.loaded[2] = held(make_spec(version_id=2), idle_s=200)
    versions.loaded[3] = held(make_spec(version_id=3), idle_s=100)
    versions.loaded[4] = held(make_spec(version_id=4), idle_s=1)  # used lately: not cold
    busy.usage.started()
    busy.usage.last_used = time.monotonic() - 300
    assert versions.coldest_version() == 2
    del versions.loaded[2]
    assert versions.coldest_version() == 3
    del versions.loaded[3]
    assert versions.coldest_version() is None


async def test_making_room_evicts_cold_versions_until_the_new_one_fits(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache, budget=10 * MiB)
    versions.loaded[1] = held(make_spec(version_id=1), 4 * MiB, idle_s=200)
    versions.loaded[2] = held(make_spec(version_id=2), 4 * MiB, idle_s=100)
    assert await versions.make_room(3, 4 * MiB) is None
    assert list(versions.loaded) == [2] and versions.memory_used() == 4 * MiB
    evicted = statuses.reports[-1]
    assert (evicted.state, evicted.version_id) == ("evicted", 1)
    assert evicted.detail.startswith("evicted to load v3: freed ")
    assert evicted.detail.endswith("(not verified, 4.0 MiB expected is too little to tell)")
    assert versions.evicted == {1: evicted.detail}
    await versions.shutdown()


async def test_an_evicted_version_stays_unloaded_while_assigned_and_loads_once_it_came_back(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache, budget=10 * MiB)
    versions.loaded[1] = held(make_spec(version_id=1), 6 * MiB, idle_s=200)
    versions.loaded[2] = held(make_spec(version_id=2), 3 * MiB, idle_s=100)
    assert await versions.make_room(3, 2 * MiB) is None
    detail = versions.evicted[1]

    versions.apply(assign(make_spec(version_id=1), make_spec(version_id=2)))
    again = await statuses.expect("evicted", 1)
    await statuses.expect("ready", 2)
    assert again.detail == detail and cache.fetched == []

    versions.apply(assign(make_spec(version_id=2)))
    assert versions.evicted == {}
    versions.apply(assign(make_spec(version_id=1), make_spec(version_id=2)))
    await statuses.expect("ready", 1)
    assert [url for url, _, _ in cache.fetched] == [PLATFORM + ARTIFACT_PATH.format(version_id=1)]
    await versions.shutdown()


async def test_a_version_that_cannot_get_room_is_not_retried_until_its_need_changes(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache, budget=10 * MiB)
    too_big = make_spec(memory_bytes=20 * MiB)
    versions.apply(assign(too_big))
    failed = await statuses.expect("failed", 1)
    assert failed.detail == ("does not fit: needs 20.0 MiB, more than the whole budget of 10.0 MiB")
    versions.apply(assign(too_big))  # as after a reconnect
    again = await statuses.expect("failed", 1)
    assert again.detail == failed.detail and len(cache.fetched) == 1

    versions.apply(assign(make_spec(memory_bytes=2 * MiB)))
    await statuses.expect("ready", 1)
    assert len(cache.fetched) == 2 and versions.unfit == {}
    await versions.shutdown()


async def test_a_busy_version_is_never_evicted(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, statuses = make_versions(cache, budget=10 * MiB)
    versions.loaded[1] = busy = held(make_spec(), 8 * MiB)
    busy.usage.started()
    problem = await versions.make_room(2, 4 * MiB)
    assert problem == (
        "does not fit: needs 4.0 MiB, 2.0 MiB free of 10.0 MiB, no cold version to evict"
    )
    assert list(versions.loaded) == [1] and statuses.reports == []
    await versions.shutdown()


async def test_heartbeat_figures_cover_every_loaded_version_by_id(
    cache: FakeCache, make_spec: Callable[..., VersionSpec]
) -> None:
    versions, _ = make_versions(cache)
    versions.loaded[7] = held(make_spec(version_id=7), 3 * MiB, idle_s=5)
    versions.loaded[2] = held(make_spec(version_id=2), 1 * MiB)
    versions.loaded[2].usage.last_used = None
    loads = versions.loads()
    assert [v.version_id for v in loads] == [2, 7]
    assert loads[0].idle_s is None and loads[1].idle_s is not None and loads[1].idle_s >= 5
    assert versions.memory_used() == 4 * MiB
    assert versions.queue_depth() == 0 and versions.streams_active() == 0
    assert versions.generation_totals().tokens_generated_total == 0
    await versions.shutdown()
