"""Memory: measuring it, the budget, and evicting the least recently used cold version when a new
one does not fit, verified by the memory actually coming back."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import importlib.util
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from serving_agent import Agent, ArtifactCache, Batcher, FunctionRuntime
from serving_agent.__main__ import memory_budget_bytes, parse_args
from serving_agent._memory import (
    HOST_BUDGET_FRACTION,
    MiB,
    available_memory_bytes,
    default_memory_budget,
    gpu_use,
    mib,
    release_memory,
    released_enough,
    rss_bytes,
)
from serving_agent._versions import Loaded, VersionUsage
from serving_agent.protocol import (
    ARTIFACT_PATH,
    Assign,
    Gpu,
    InferResult,
    TensorSpec,
    VersionSpec,
    decode_frame,
)
from tests.agent.conftest import infer_message, running

if TYPE_CHECKING:
    from tests.agent.conftest import FakePlatform, TinyModel

TOKEN = "node-token"
WIDTH = 3000  # a 3000 x 3000 float32 weight: a 36 MB artifact, well above allocator noise
A, B = 10, 11


@pytest.fixture(autouse=True, scope="module")
def frozen_heap() -> Iterator[None]:
    """Freeze the imported heap as ``python -m serving_agent`` does: the agent's full
    collections then skip it, which here is torch and every test module (~0.2 s a collection)."""
    gc.freeze()
    yield
    gc.unfreeze()


@dataclass
class Artifact:
    path: Path
    data: bytes
    sha256: str


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    """``y = x @ w`` with a random (so really resident) 3000 x 3000 weight."""
    weight = np.random.default_rng(0).standard_normal((WIDTH, WIDTH), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what the installed onnxruntime reads
    path = tmp_path_factory.mktemp("big") / "big.onnx"
    onnx.save(model, path)
    data = path.read_bytes()
    return Artifact(path=path, data=data, sha256=hashlib.sha256(data).hexdigest())


@pytest.fixture
def big_spec(big_model: Artifact) -> Callable[[int], VersionSpec]:
    def make(version_id: int) -> VersionSpec:
        return VersionSpec(
            version_id=version_id,
            model="big",
            version=version_id,
            sha256=big_model.sha256,
            artifact_url=ARTIFACT_PATH.format(version_id=version_id),
            inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1, WIDTH])],
            outputs=[TensorSpec(name="y", datatype="FP32", shape=[-1, WIDTH])],
            max_batch_size=1,
            device="cpu",
        )

    return make


@pytest.fixture
def budget(big_model: Artifact) -> int:
    """Fits one big version (which needs twice its artifact) but not a second beside it."""
    return int(2.5 * len(big_model.data))


@pytest.fixture
def big_platform(platform: FakePlatform, big_model: Artifact) -> FakePlatform:
    platform.artifacts[A] = platform.artifacts[B] = big_model.data
    return platform


def make_agent(url: str, tmp_path: Path, budget: int, cold_after_s: float = 0.0) -> Agent:
    return Agent(
        url,
        TOKEN,
        ArtifactCache(tmp_path / "cache"),
        name="test-node",
        retry_base=0.05,
        retry_cap=0.2,
        memory_budget_bytes=budget,
        cold_after_s=cold_after_s,
    )


def assign(*specs: VersionSpec) -> str:
    return Assign(versions=list(specs)).model_dump_json()


def loads(platform: FakePlatform, version_id: int) -> int:
    """How many times the agent started loading a version."""
    return sum(
        1
        for m in platform.log
        if m["type"] == "status" and m["version_id"] == version_id and m["state"] == "loading"
    )


def freed_mib(detail: str) -> tuple[float, float]:
    """An eviction's measured (freed, expected) MiB, from its status detail."""
    match = re.fullmatch(
        r"evicted to load v\d+: freed (-?[\d.]+) MiB \(measured, ([\d.]+) MiB expected\)", detail
    )
    assert match, detail
    return float(match[1]), float(match[2])


# Measuring ------------------------------------------------------------------------------------


def test_rss_shows_a_freed_allocation_coming_back() -> None:
    release_memory()
    before = rss_bytes()
    held = np.ones(64 * MiB // 8)  # ones, not zeros: every page is really written
    footprint = rss_bytes() - before
    del held
    release_memory()
    freed = before + footprint - rss_bytes()
    assert footprint >= 60 * MiB
    assert released_enough(footprint, freed) and freed >= footprint / 2


def test_memory_still_referenced_does_not_count_as_released() -> None:
    release_memory()
    before = rss_bytes()
    held = np.ones(64 * MiB // 8)
    footprint = rss_bytes() - before
    release_memory()
    freed = before + footprint - rss_bytes()
    assert not released_enough(footprint, freed)
    del held


def test_a_footprint_too_small_to_measure_is_not_checked() -> None:
    assert released_enough(1 * MiB, 0)
    assert not released_enough(64 * MiB, 31 * MiB)
    assert released_enough(64 * MiB, 32 * MiB)


def test_an_unload_is_expected_to_free_no_more_than_the_artifact() -> None:
    # The first version of a runtime also measured the runtime's one-time setup, which stays.
    first = VersionUsage(measured_bytes=83 * MiB, artifact_bytes=10 * MiB)
    assert first.releasable_bytes == 10 * MiB
    larger = VersionUsage(measured_bytes=40 * MiB, artifact_bytes=36 * MiB)
    assert larger.releasable_bytes == 36 * MiB
    smaller = VersionUsage(measured_bytes=2 * MiB, artifact_bytes=36 * MiB)
    assert smaller.releasable_bytes == 2 * MiB


def test_the_default_budget_is_the_gpu_memory_else_a_share_of_what_is_available() -> None:
    h100 = Gpu(name="NVIDIA H100", memory_bytes=80 * 1024 * MiB)
    assert default_memory_budget([h100], available=1000 * MiB) == 80 * 1024 * MiB
    unknown = Gpu(name="NVIDIA A10", memory_bytes=0)
    assert default_memory_budget([unknown], available=1000) == int(1000 * HOST_BUDGET_FRACTION)
    assert default_memory_budget([], available=1000) == int(1000 * HOST_BUDGET_FRACTION)
    assert default_memory_budget([]) > 0  # this machine's /proc/meminfo


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, 800 * 1024),
        ({"memory.max": "max", "memory.current": "100"}, 800 * 1024),
        ({"memory.max": "500000", "memory.current": "100000"}, 400_000),
        (
            {"memory/memory.limit_in_bytes": "300000", "memory/memory.usage_in_bytes": "100000"},
            200_000,
        ),
        (
            {
                "memory/memory.limit_in_bytes": str(2**63 - 4096),
                "memory/memory.usage_in_bytes": "1",
            },
            800 * 1024,
        ),
    ],
)
def test_available_memory_is_capped_by_the_cgroup_limit(
    tmp_path: Path, files: dict[str, str], expected: int
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:    800 kB\n")
    cgroup = tmp_path / "cgroup"
    for name, text in files.items():
        (cgroup / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / name).write_text(text + "\n")
    assert available_memory_bytes(meminfo, cgroup) == expected


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this node has an NVIDIA driver")
def test_a_node_without_an_nvidia_driver_reports_no_gpu_use() -> None:
    # NVML (nvidia-ml-py, a dependency) is installed but finds no driver: nothing to report,
    # and nothing raised into the heartbeat.
    assert importlib.util.find_spec("pynvml") is not None
    assert gpu_use() == [] and gpu_use() == []


def test_budget_cold_time_and_deployment_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SWITCHYARD_AGENT_MEMORY_MB", "SWITCHYARD_DEPLOYMENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SWITCHYARD_AGENT_COLD_AFTER_S", raising=False)
    base = ["--platform", "http://p", "--token", "t"]
    args = parse_args(base)
    assert (memory_budget_bytes(args), args.cold_after_s, args.deployment) == (0, 30.0, None)
    args = parse_args(
        [*base, "--memory-budget-mb", "512", "--cold-after-s", "0", "--deployment", "fraud-cpu"]
    )
    assert (memory_budget_bytes(args), args.cold_after_s, args.deployment) == (
        512 * MiB,
        0.0,
        "fraud-cpu",
    )
    monkeypatch.setenv("SWITCHYARD_AGENT_MEMORY_MB", "1.5")
    monkeypatch.setenv("SWITCHYARD_DEPLOYMENT", "from-env")
    monkeypatch.setenv("SWITCHYARD_AGENT_COLD_AFTER_S", "5")
    args = parse_args(base)
    assert (memory_budget_bytes(args), args.cold_after_s, args.deployment) == (
        int(1.5 * MiB),
        5.0,
        "from-env",
    )
    for bad in (["--memory-budget-mb", "0"], ["--cold-after-s", "-1"]):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])


@pytest.mark.anyio
async def test_hello_names_the_deployment_and_the_budget(tmp_path: Path) -> None:
    agent = make_agent("http://platform.test", tmp_path, budget=123 * MiB)
    agent.deployment = "fraud-cpu"
    hello = await agent.hello()
    assert (hello.deployment, hello.memory_budget_bytes) == ("fraud-cpu", 123 * MiB)
    agent.cache.close()
    agent = make_agent("http://platform.test", tmp_path, budget=0)
    default = await agent.hello()
    assert default.deployment is None and default.memory_budget_bytes > 0
    assert agent.memory_budget_bytes == default.memory_budget_bytes
    agent.cache.close()


# Eviction, end to end ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_tiny_version_counts_at_least_its_artifact(
    platform: FakePlatform,
    tmp_path: Path,
    tiny_model: TinyModel,
    make_spec: Callable[..., VersionSpec],
) -> None:
    async with running(make_agent(platform.url, tmp_path, budget=64 * MiB), timeout=10):
        ws = await platform.next_connection()
        await ws.send(assign(make_spec()))
        ready = await platform.expect("status", state="ready", version_id=1)
    assert ready["memory_bytes"] >= len(tiny_model.data) > 0


@pytest.mark.anyio
async def test_a_version_that_does_not_fit_evicts_the_least_recently_used_cold_one(
    big_platform: FakePlatform,
    tmp_path: Path,
    big_model: Artifact,
    big_spec: Callable[[int], VersionSpec],
    budget: int,
) -> None:
    platform = big_platform
    async with running(make_agent(platform.url, tmp_path, budget), timeout=10) as agent:
        ws = await platform.next_connection()
        await ws.send(assign(big_spec(A)))
        ready_a = await platform.expect("status", state="ready", version_id=A)
        assert len(big_model.data) <= ready_a["memory_bytes"] <= budget
        await ws.send(infer_message(1, np.ones((1, WIDTH), np.float32), version_id=A))
        header, _ = decode_frame(await platform.next_frame())
        assert isinstance(header, InferResult)
        (load_a,) = agent.heartbeat().versions
        assert (load_a.version_id, load_a.requests_total, load_a.in_flight) == (A, 1, 0)
        assert load_a.idle_s is not None

        await ws.send(assign(big_spec(A), big_spec(B)))
        evicted = await platform.expect("status", state="evicted", version_id=A)
        ready_b = await platform.expect("status", state="ready", version_id=B)
        freed, expected = freed_mib(evicted["detail"])
        assert expected >= 8 and freed >= expected / 2
        assert freed >= len(big_model.data) / MiB / 2

        heartbeat = agent.heartbeat()
        assert heartbeat.evicted == [A] and [v.version_id for v in heartbeat.versions] == [B]
        assert heartbeat.versions[0].idle_s is None  # never used
        assert heartbeat.memory_used_bytes == ready_b["memory_bytes"]
        assert heartbeat.memory_budget_bytes == budget and heartbeat.gpus == gpu_use()

        # The same assignment again (as after a reconnect): A stays evicted, not reloaded.
        await ws.send(assign(big_spec(A), big_spec(B)))
        again = await platform.expect("status", state="evicted", version_id=A)
        await platform.expect("status", state="ready", version_id=B)
        assert again["detail"] == evicted["detail"] and loads(platform, A) == 1
        assert list(agent.versions.loaded) == [B]


@pytest.mark.anyio
async def test_an_evicted_version_that_left_and_came_back_is_loaded_again(
    big_platform: FakePlatform,
    tmp_path: Path,
    big_spec: Callable[[int], VersionSpec],
    budget: int,
) -> None:
    platform = big_platform
    async with running(make_agent(platform.url, tmp_path, budget), timeout=10) as agent:
        ws = await platform.next_connection()
        await ws.send(assign(big_spec(A)))
        await platform.expect("status", state="ready", version_id=A)
        await ws.send(assign(big_spec(A), big_spec(B)))
        await platform.expect("status", state="ready", version_id=B)

        await ws.send(assign(big_spec(B)))
        await platform.expect("status", state="ready", version_id=B)
        assert agent.versions.evicted == {}
        await ws.send(assign(big_spec(A), big_spec(B)))
        evicted = await platform.expect("status", state="evicted", version_id=B)
        await platform.expect("status", state="ready", version_id=A)
        freed, expected = freed_mib(evicted["detail"])
        assert freed >= expected / 2
        assert loads(platform, A) == 2 and list(agent.versions.loaded) == [A]
        assert agent.heartbeat().evicted == [B]


@pytest.mark.anyio
async def test_a_recently_used_version_is_not_evicted_and_the_new_one_does_not_fit(
    big_platform: FakePlatform,
    tmp_path: Path,
    big_model: Artifact,
    big_spec: Callable[[int], VersionSpec],
    budget: int,
) -> None:
    platform = big_platform
    async with running(
        make_agent(platform.url, tmp_path, budget, cold_after_s=3600), timeout=10
    ) as agent:
        ws = await platform.next_connection()
        await ws.send(assign(big_spec(A)))
        await platform.expect("status", state="ready", version_id=A)
        await ws.send(assign(big_spec(A), big_spec(B)))
        failed = await platform.expect("status", state="failed", version_id=B)
        used = agent.versions.memory_used()
        assert failed["detail"] == (
            f"does not fit: needs {mib(2 * len(big_model.data))}, {mib(budget - used)} free of "
            f"{mib(budget)}, no cold version to evict"
        )
        assert list(agent.versions.loaded) == [A] and agent.versions.evicted == {}

        # A reconnect re-assigns the same set: B is reported failed again, not retried.
        await ws.close(1011, "platform restarting")
        ws = await platform.next_connection()
        await ws.send(assign(big_spec(A), big_spec(B)))
        await platform.expect("status", state="ready", version_id=A)
        again = await platform.expect("status", state="failed", version_id=B)
        assert again["detail"] == failed["detail"] and loads(platform, B) == 1


def blocking_version(spec: VersionSpec, gate: threading.Event, footprint: int) -> Loaded:
    """A version whose requests wait for ``gate``, claiming a ``footprint`` measured at load."""

    def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        gate.wait(10)
        return [inputs["x"][:, :2]]

    runtime = FunctionRuntime(run, ["x"], ["y"])
    usage = VersionUsage(memory_bytes=footprint, measured_bytes=footprint, artifact_bytes=footprint)
    return Loaded(spec, runtime, Batcher(runtime, inline=False), usage)


@pytest.mark.anyio
async def test_a_version_with_a_request_in_flight_is_not_evicted(
    big_platform: FakePlatform,
    tmp_path: Path,
    big_spec: Callable[[int], VersionSpec],
    make_spec: Callable[..., VersionSpec],
    budget: int,
) -> None:
    platform, gate = big_platform, threading.Event()
    small = make_spec()
    try:
        async with running(make_agent(platform.url, tmp_path, budget), timeout=10) as agent:
            ws = await platform.next_connection()
            agent.versions.loaded[1] = blocking_version(small, gate, budget // 2)
            await ws.send(infer_message(1, np.zeros((1, 4), np.float32)))
            async with asyncio.timeout(5):
                while agent.versions.loaded[1].in_flight == 0:
                    await asyncio.sleep(0.01)
            await ws.send(assign(small, big_spec(B)))
            failed = await platform.expect("status", state="failed", version_id=B)
            assert failed["detail"].startswith("does not fit: ")
            assert failed["detail"].endswith(", no cold version to evict")
            assert agent.heartbeat().versions[0].in_flight == 1
            gate.set()
            header, _ = decode_frame(await platform.next_frame())
            assert isinstance(header, InferResult)
    finally:
        gate.set()


@pytest.mark.anyio
async def test_a_version_larger_than_the_whole_budget_evicts_nothing(
    tmp_path: Path, make_spec: Callable[..., VersionSpec]
) -> None:
    agent = make_agent("http://platform.test", tmp_path, budget=10 * MiB)
    agent.versions.loaded[1] = blocking_version(make_spec(), threading.Event(), 4 * MiB)
    problem = await agent.versions.make_room(2, 20 * MiB)
    assert problem == "does not fit: needs 20.0 MiB, more than the whole budget of 10.0 MiB"
    assert list(agent.versions.loaded) == [1] and agent.versions.evicted == {}
    await agent.shutdown()
    agent.cache.close()


@pytest.mark.anyio
async def test_an_eviction_whose_memory_does_not_come_back_stops_the_load(
    big_platform: FakePlatform,
    tmp_path: Path,
    big_spec: Callable[[int], VersionSpec],
    make_spec: Callable[..., VersionSpec],
    budget: int,
) -> None:
    # The victim claims 64 MiB measured at load but holds none of it, as a leaking model would.
    platform, gate = big_platform, threading.Event()
    gate.set()
    small = make_spec()
    release_memory()  # garbage of earlier tests must not be counted as freed by the eviction
    async with running(make_agent(platform.url, tmp_path, budget), timeout=10) as agent:
        ws = await platform.next_connection()
        agent.versions.loaded[1] = blocking_version(small, gate, 64 * MiB)
        await ws.send(assign(small, big_spec(B)))
        evicted = await platform.expect("status", state="evicted", version_id=1)
        failed = await platform.expect("status", state="failed", version_id=B)
        assert evicted["detail"].endswith("(memory not released, 64.0 MiB expected)")
        assert re.fullmatch(
            r"memory not released: evicting v1 freed -?[\d.]+ MiB of the 64.0 MiB expected",
            failed["detail"],
        )
        assert agent.versions.loaded == {} and agent.heartbeat().evicted == [1]
