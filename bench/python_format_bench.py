"""What the ``python`` format costs against the same model as ONNX, per batch and per request.

One model, the demo fraud classifier's shape (32 → 256 → 256 → 2, softmax; random weights from
a seed), twice: as an ONNX version, and as a ``python`` package whose class runs that same ONNX
file with ONNX Runtime (``onnxruntime==1.31.1``, one thread) in ``predict``.

- **Per batch, in process** (no HTTP): the agent's own loaders, ONNX Runtime
  (``serving_agent._runtime.load_runtime``) and the package's sandboxed worker
  (``serving_agent._python``: ``prepare_python`` then ``load_python``), and the same package
  with the sandbox off (``SWITCHYARD_SANDBOX=off``), to tell the sandbox's own cost from the
  process hop's, and a class of the same package and environment that does no work (zeros
  back): the hop alone. Median time per ``run()`` at batch 1/8/32/128, and the CPU time of
  this process and the worker per call (the scheduler's counters), in paired, interleaved
  rounds (each round times every runtime at every batch size, the order rotated round by
  round); ratios and added microseconds are medians of the rounds' pairs. This process and
  the workers it starts are pinned to one CPU (``--cpu``, CPU 0), as an agent pinned to one
  core and its workers are.
- **Per request, through the platform** (``--no-platform`` skips it): uvicorn and an agent on
  the embedded backend, both pinned to CPU 0 (the agent's workers inherit it), wrk on CPU 1,
  both versions uploaded through the API; OIP v2 requests of one row at 1 and 16 connections,
  the two models alternating run by run (``--rounds``), medians of the runs and of the pairs'
  ratios. Server CPU per request counts uvicorn, the agent and the package's worker.

Run: ``.venv/bin/python bench/python_format_bench.py`` (as root for the sandbox; needs wrk and
taskset for the platform part, and the package index for the worker's environment, built once
under ``--sandbox-dir``). About 2-3 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oip_bench import cpu_seconds, run_wrk  # noqa: E402

from serving_agent._python import load_python, prepare_python  # noqa: E402
from serving_agent._runtime import Runtime, load_runtime  # noqa: E402
from serving_agent.protocol import TensorSpec, VersionSpec  # noqa: E402
from tests.e2e.conftest import upload_and_promote  # noqa: E402
from tests.e2e.harness import (  # noqa: E402
    PY,
    SERVER_ARGS,
    Proc,
    create_node,
    create_tenant,
    embedded_backend,
    free_port,
    wait_until,
)
from tests.python_packages import pack  # noqa: E402

FEATURES = 32
BATCHES = (1, 8, 32, 128)
INPUTS = [TensorSpec(name="features", datatype="FP32", shape=[-1, FEATURES])]
OUTPUTS = [TensorSpec(name="probabilities", datatype="FP32", shape=[-1, 2])]
ENV_BUILD_TIMEOUT_S = 300  # onnxruntime from the index on a first build

MANIFEST = """\
[model]
entrypoint = "model:{cls}"

[[inputs]]
name = "features"
datatype = "FP32"
shape = [-1, 32]

[[outputs]]
name = "probabilities"
datatype = "FP32"
shape = [-1, 2]

[resources]
memory_mib = 1024
cpus = 1
timeout_s = 10
"""
MODEL_PY = '''\
"""The ONNX version's graph, run with ONNX Runtime as the agent runs it (one thread)."""

from pathlib import Path

import numpy as np
import onnxruntime

# Beside this file rather than relative to the working directory: an unsandboxed worker
# (SWITCHYARD_SANDBOX=off) runs in the agent's working directory, not the package's.
GRAPH = Path(__file__).parent / "artifacts" / "model.onnx"


class Mlp:
    def load(self):
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(
            str(GRAPH), options, providers=["CPUExecutionProvider"]
        )

    def predict(self, batch):
        (probabilities,) = self.session.run(None, {"features": batch["features"]})
        return probabilities


class Zeros:
    """No model work: what is left is the hop to the worker and back."""

    def predict(self, batch):
        return np.zeros((len(batch["features"]), 2), dtype=np.float32)
'''


def mlp_onnx(seed: int = 0) -> bytes:
    """features [-1, 32] FP32 -> probabilities [-1, 2]: the demo fraud MLP's layers."""
    rng = np.random.default_rng(seed)
    sizes = [FEATURES, 256, 256, 2]
    nodes, weights, last = [], [], "features"
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        w = (rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.normal(size=n_out) * 0.1).astype(np.float32)
        weights += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("Gemm", [last, f"w{i}", f"b{i}"], [f"h{i}"]))
        last = f"h{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [last], [f"r{i}"]))
            last = f"r{i}"
    nodes.append(helper.make_node("Softmax", [last], ["probabilities"], axis=1))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 2])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_package(folder: Path, graph: bytes, cls: str = "Mlp") -> bytes:
    """The package (its folder ``folder``) with ``cls`` its entrypoint, packed as a client
    uploads it."""
    (folder / "artifacts").mkdir(parents=True)
    (folder / "switchyard.toml").write_text(MANIFEST.format(cls=cls))
    (folder / "model.py").write_text(MODEL_PY)
    (folder / "requirements.txt").write_text("onnxruntime==1.31.1\n")
    (folder / "artifacts" / "model.onnx").write_bytes(graph)
    return pack(folder)


def spec_of(fmt: str, artifact: bytes, version_id: int = 1) -> VersionSpec:
    return VersionSpec(
        version_id=version_id,
        model=f"mlp-{fmt}",
        version=version_id,
        sha256=hashlib.sha256(artifact).hexdigest(),
        artifact_url="",
        format=fmt,
        inputs=INPUTS,
        outputs=OUTPUTS,
        max_batch_size=max(BATCHES),
        device="cpu",
        tenant_id=1,
    )


# Per batch, in process -------------------------------------------------------------------

ONNX, PYTHON, UNSANDBOXED, HOP = "ONNX", "python", "python, sandbox off", "python, no model work"


def load_runtimes(tmp: Path, graph: bytes, archive: bytes) -> dict[str, Runtime]:
    """ONNX Runtime as the agent loads it; the package's worker sandboxed and not; and a
    package of the same environment whose class does no work (the hop alone)."""
    onnx_path = tmp / "model.onnx"
    onnx_path.write_bytes(graph)
    runtimes: dict[str, Runtime] = {ONNX: load_runtime(onnx_path, spec_of("onnx", graph))}
    hop = write_package(tmp / "zeros", graph, "Zeros")
    packages = {}
    for number, (name, data) in enumerate((("mlp", archive), ("zeros", hop)), start=2):
        path = tmp / f"{name}.tar.gz"
        path.write_bytes(data)
        packages[name] = (path, spec_of("python", data, number))

    async def progress(message: str) -> None:
        print(f"  {message}", flush=True)

    started = time.monotonic()
    for path, spec in packages.values():
        asyncio.run(prepare_python(path, spec, progress))
    print(f"  packages prepared in {time.monotonic() - started:.1f} s", flush=True)
    for label, name, mode in (
        (PYTHON, "mlp", "on"),
        (UNSANDBOXED, "mlp", "off"),
        (HOP, "zeros", "on"),
    ):
        os.environ["SWITCHYARD_SANDBOX"] = mode  # read when a worker starts
        try:
            runtimes[label] = load_python(*packages[name])
        except Exception as exc:  # noqa: BLE001 - a node that cannot sandbox: the row is left out
            print(f"  {label}: not measured ({exc})", flush=True)
    os.environ.pop("SWITCHYARD_SANDBOX", None)
    return runtimes


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in descendants(k)]


def worker_pids(runtime: Runtime) -> list[int]:
    """A python runtime's worker: its process tree (bwrap, the sandbox's init, the python)."""
    process = getattr(runtime, "_process", None)
    return [] if process is None else [process.popen.pid, *descendants(process.popen.pid)]


def on_cpu_s(pids: list[int]) -> float:
    """CPU time of every thread of ``pids``, from the scheduler's nanosecond counters."""
    total = 0
    for pid in pids:
        for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(stat.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total / 1e9


def per_call_us(
    runtime: Runtime, pids: list[int], feed: dict[str, np.ndarray], calls: int, budget: float
) -> tuple[float, float, float]:
    """Mean µs per ``run()`` over up to ``calls`` calls or ``budget`` seconds: wall time, the
    CPU time of this process (the agent's side) and of the worker (``pids``)."""
    own, worker = time.process_time(), on_cpu_s(pids)
    n, start = 0, time.perf_counter()
    deadline = start + budget
    while n < calls:
        runtime.run(feed)
        n += 1
        if time.perf_counter() > deadline:
            break
    wall = time.perf_counter() - start
    own, worker = time.process_time() - own, on_cpu_s(pids) - worker
    return wall / n * 1e6, own / n * 1e6, worker / n * 1e6


def batch_rounds(runtimes: dict[str, Runtime], args: argparse.Namespace) -> str:
    feeds = {
        b: {"features": np.random.default_rng(b).normal(size=(b, FEATURES)).astype(np.float32)}
        for b in BATCHES
    }
    for b, feed in feeds.items():  # the same answers, and every runtime warm at every size
        want = runtimes[ONNX].run(feed)[0]
        for label, runtime in runtimes.items():
            for _ in range(20):
                got = runtime.run(feed)[0]
            if label != HOP:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{b} rows")
    pids = {label: worker_pids(runtime) for label, runtime in runtimes.items()}
    labels = list(runtimes)
    # (runtime, batch) -> [(wall µs, CPU µs, agent CPU µs, worker CPU µs) per round]
    times: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {
        (k, b): [] for k in labels for b in BATCHES
    }
    for r in range(args.batch_rounds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for b in BATCHES:
            for label in order:
                wall, own, worker = per_call_us(
                    runtimes[label], pids[label], feeds[b], args.calls, args.round_seconds
                )
                times[label, b].append((wall, own + worker, own, worker))

    def med(label: str, b: int, i: int) -> float:
        return statistics.median(t[i] for t in times[label, b])

    def paired(a: str, o: str, b: int, i: int, ratio: bool = False) -> float:
        pairs = zip(times[a, b], times[o, b], strict=True)
        return statistics.median(x[i] / y[i] if ratio else x[i] - y[i] for x, y in pairs)

    lines = [
        "| batch | runtime | µs/call | CPU µs/call | CPU: agent / worker | / ONNX "
        "| added µs/call | added µs/row | added CPU µs/call |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in BATCHES:
        for label in labels:
            row = [str(b), label, f"{med(label, b, 0):,.1f}", f"{med(label, b, 1):,.1f}"]
            row.append(f"{med(label, b, 2):,.1f} / {med(label, b, 3):,.1f}")
            if label == ONNX:
                row += ["–"] * 4
            else:
                added = paired(label, ONNX, b, 0)
                row += [f"{paired(label, ONNX, b, 0, ratio=True):.2f}x", f"{added:+,.1f}"]
                row += [f"{added / b:+,.2f}", f"{paired(label, ONNX, b, 1):+,.1f}"]
            lines.append("| " + " | ".join(row) + " |")
    if PYTHON in runtimes and UNSANDBOXED in runtimes:
        on, off = PYTHON, UNSANDBOXED
        cost = ", ".join(
            f"{paired(on, off, b, 0):+,.1f} µs ({paired(on, off, b, 1):+,.1f} CPU) at {b}"
            for b in BATCHES
        )
        lines.append(f"\nSandbox on − off, paired medians per call: {cost}.")
    return "\n".join(lines)


# Per request, through the platform -------------------------------------------------------


def upload_python(client: httpx.Client, name: str, archive: bytes) -> None:
    created = client.post("/api/v1/models", json={"name": name, "task": "classifier"})
    assert created.status_code == 201, created.text
    files = {"artifact": (f"{name}.tar.gz", archive, "application/gzip")}
    version = client.post(f"/api/v1/models/{name}/versions", files=files, data={"format": "python"})
    assert version.status_code == 201, version.text
    moved = client.put(f"/api/v1/models/{name}/aliases/production", json={"version": 1})
    assert moved.status_code == 200, moved.text


def platform_rounds(tmp: Path, graph: bytes, args: argparse.Namespace) -> str:
    backend = embedded_backend(tmp)
    backend.env |= {
        "SWITCHYARD_SANDBOX_DIR": str(args.sandbox_dir),  # the environment built above
        "SWITCHYARD_SANDBOX": "on",
        "LOG_LEVEL": "WARNING",
    }
    running: list[Proc] = []
    try:
        token = create_node(backend, "bench-node")
        key = create_tenant(backend, "bench", rps=1_000_000, burst=1_000_000)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server_cmd = ["taskset", "-c", "0", PY, *SERVER_ARGS["uvicorn"].format(port=port).split()]
        server = Proc("uvicorn", [*server_cmd, "--log-level", "warning"], backend.env, tmp)
        running.append(server)
        wait_until(lambda: _ok(f"{url}/v2/health/live", {}), 60, server)
        agent_cmd = ["taskset", "-c", "0", PY, "-m", "serving_agent", "--platform", url]
        agent_cmd += ["--token", token, "--cache-dir", str(tmp / "cache")]
        agent = Proc("agent", [*agent_cmd, "--log-level", "WARNING"], backend.env, tmp)
        running.append(agent)
        headers = {"Authorization": f"Bearer {key}"}
        models = {"ONNX": "mlp-onnx", "python": "mlp-python"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            upload_and_promote(client, models["ONNX"], graph)
            # Packed in a folder: another artifact (hash) than the in-process part extracted for
            # its tenant, so this tenant's workers get an extraction of their own.
            upload_python(client, models["python"], pack(tmp / "mlp", root="mlp"))
            features = np.random.default_rng(1).normal(size=FEATURES).round(4).tolist()
            body = {"inputs": [{"name": "features", "shape": [1, FEATURES]}]}
            body["inputs"][0] |= {"datatype": "FP32", "data": features}
            answers = []
            for name in models.values():
                ready = partial(_ok, f"{url}/v2/models/{name}/ready", headers)
                wait_until(ready, ENV_BUILD_TIMEOUT_S, agent)
                answer = client.post(f"/v2/models/{name}/infer", json=body)
                assert answer.status_code == 200, answer.text
                answers.append(answer.json()["outputs"][0]["data"])
            np.testing.assert_allclose(answers[0], answers[1], rtol=1e-5, atol=1e-6)
        pids = [server.popen.pid, agent.popen.pid]
        connections = [int(c) for c in args.connections.split(",")]
        results: dict[tuple[str, int], list[dict[str, float]]] = {
            (m, c): [] for m in models for c in connections
        }
        for c in connections:  # warm-up: every model at every count, unmeasured
            for name in models.values():
                run_wrk(f"{url}/v2/models/{name}/infer", c, args.warmup, key, json.dumps(body))
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for c in connections:
                for label in order:
                    infer = f"{url}/v2/models/{models[label]}/infer"
                    before = sum(cpu_seconds(p) for p in pids)
                    result = run_wrk(infer, c, args.seconds, key, json.dumps(body))
                    used = sum(cpu_seconds(p) for p in pids) - before
                    result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
                    result["cpu_ms"] = used * 1000 / max(result["requests"], 1)
                    results[label, c].append(result)
                    print(
                        f"  round {r + 1} {label} c={c}: {result['rps']:,.0f} req/s, "
                        f"p99 {result['p99_us'] / 1000:.2f} ms, {result['cpu_ms']:.3f} CPU ms/req",
                        flush=True,
                    )
    finally:
        for proc in reversed(running):
            proc.stop()
        backend.close()
    return _platform_table(results, models, connections)


def _platform_table(
    results: dict[tuple[str, int], list[dict[str, float]]],
    models: dict[str, str],
    connections: list[int],
) -> str:
    def med(label: str, c: int, key: str) -> float:
        return statistics.median(r[key] for r in results[label, c])

    def pair(c: int, key: str, fn: Callable[[float, float], float]) -> float:
        runs = zip(results["python", c], results["ONNX", c], strict=True)
        return statistics.median(fn(p[key], o[key]) for p, o in runs)

    lines = [
        "| model | connections | req/s | p50 ms | p99 ms | server CPU ms/req | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in connections:
        for label in models:
            errors = sum(r["errors"] for r in results[label, c])
            lines.append(
                f"| {label} | {c} | {med(label, c, 'rps'):,.0f} | "
                f"{med(label, c, 'p50_us') / 1000:.2f} | {med(label, c, 'p99_us') / 1000:.2f} | "
                f"{med(label, c, 'cpu_ms'):.3f} | {errors} |"
            )
    lines += [
        "",
        "| connections | req/s python / ONNX | p50 added ms | server CPU added ms/req |",
        "| --- | --- | --- | --- |",
    ]
    for c in connections:
        lines.append(
            f"| {c} | {pair(c, 'rps', lambda p, o: p / o):.2f}x | "
            f"{pair(c, 'p50_us', lambda p, o: p - o) / 1000:+.2f} | "
            f"{pair(c, 'cpu_ms', lambda p, o: p - o):+.3f} |"
        )
    return "\n".join(lines)


def _ok(url: str, headers: dict[str, str]) -> bool:
    try:
        return httpx.get(url, headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000, help="most run() calls a round")
    parser.add_argument("--round-seconds", type=float, default=0.2, help="most time a round")
    parser.add_argument("--cpu", type=int, default=0, help="the CPU the in-process part runs on")
    parser.add_argument("--no-platform", action="store_true", help="the in-process part only")
    parser.add_argument("--rounds", type=int, default=3, help="platform runs per model and count")
    parser.add_argument("--seconds", type=int, default=5, help="one measured wrk run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--connections", default="1,16")
    parser.add_argument(
        "--sandbox-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "switchyard-python-bench-sandbox",
        help="environments and extracted packages (kept, so the environment is built once)",
    )
    args = parser.parse_args()
    if not args.no_platform and shutil.which("wrk") is None:
        parser.error("wrk is missing (apt-get install wrk), or pass --no-platform")
    os.environ["SWITCHYARD_SANDBOX_DIR"] = str(args.sandbox_dir)
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-python-bench-"))
    extracted = args.sandbox_dir / "packages"  # this run's extractions are removed at the end
    before = set(extracted.iterdir()) if extracted.is_dir() else set()
    graph = mlp_onnx()
    archive = write_package(tmp / "mlp", graph)
    print(
        f"Run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} "
        f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}): MLP 32→256→256→2, "
        f"ONNX against a python package running it with ONNX Runtime.\n",
        flush=True,
    )
    try:
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {args.cpu})  # the workers started below inherit it
        runtimes = load_runtimes(tmp, graph, archive)
        try:
            batch_table = batch_rounds(runtimes, args)
        finally:
            for runtime in runtimes.values():
                runtime.close()
            os.sched_setaffinity(0, allowed)
        print(
            f"\nPer batch, in process, CPU {args.cpu}: median of {args.batch_rounds} paired "
            f"rounds (up to {args.calls} calls or {args.round_seconds} s each)\n"
        )
        print(batch_table, flush=True)
        if not args.no_platform:
            print("\nThrough the platform (uvicorn, agent and worker on CPU 0, wrk on CPU 1):")
            table = platform_rounds(tmp, graph, args)
            print(
                f"\nPer request through the platform, OIP v2 one row: medians of {args.rounds} "
                f"runs of {args.seconds} s per model and count, alternating\n"
            )
            print(table, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for path in set(extracted.iterdir()) - before if extracted.is_dir() else ():
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
