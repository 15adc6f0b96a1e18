"""Peer model servers for ``bench/oip_bench.py --peers``: KServe's Python model server, TorchServe
and (optionally) MLServer, installed from PyPI into venvs of their own and serving the same ONNX
file as Switchyard's case, pinned to CPU 0 like Switchyard's processes.

The venvs are made on first use and reused while their pins stay the same (never in CI):
``bench/.peers-venv`` (KServe, TorchServe) and ``bench/.mlserver-venv`` (MLServer, whose pins
conflict with KServe's). ``python bench/peers_bench.py --setup kserve,torchserve,mlserver`` makes
them ahead of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.harness import Proc, free_port, wait_until  # noqa: E402

PEERS_DIR = ROOT / "bench" / "peers"
MODEL = "fraud-detector"
# venv -> pip steps, in order. torch comes first and alone so that nothing later pulls a CUDA
# build of it (TorchServe imports torch; the model itself runs on ONNX Runtime).
VENVS: dict[str, list[list[str]]] = {
    ".peers-venv": [
        ["torch==2.13.0"],
        [
            "kserve==0.21.0",
            "torchserve==0.12.0",
            "torch-model-archiver==0.12.0",
            "onnxruntime==1.31.1",
            "numpy==2.4.6",
            "tokenizers==0.23.3",  # the MiniLM peers of bench/embed_bench.py
        ],
    ],
    ".mlserver-venv": [
        ["mlserver==1.7.1", "uvloop==0.21.0", "onnxruntime==1.31.1", "numpy==2.4.6"]
    ],
}
# TorchServe's server-side batching, as in DESIGN.md's table of peers.
TORCHSERVE_BATCH_SIZE = 32
TORCHSERVE_MAX_BATCH_DELAY_MS = 5


@dataclass
class Peer:
    """A running peer: where wrk posts, and its processes (CPU is read from their trees)."""

    label: str
    url: str
    procs: list[Proc] = field(default_factory=list)

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs]

    def stop(self) -> None:
        """Stop the peer and wait for its whole process group: TorchServe's frontend (java)
        shuts down for a few seconds after the command that started it has gone."""
        for proc in self.procs:
            proc.stop()
            deadline = time.monotonic() + 20
            while _group_alive(proc.popen.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(proc.popen.pid):
                os.killpg(proc.popen.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def version(package: str) -> str:
    """The version pinned in ``VENVS``, for the rows' labels."""
    pins = (pin.split("==") for steps in VENVS.values() for step in steps for pin in step)
    return next(v for name, v in pins if name == package)


def ensure_venv(name: str) -> Path:
    """The venv's bin folder, made (or remade) when its recorded pins differ from ``VENVS``."""
    venv = ROOT / "bench" / name
    stamp = venv / "switchyard-pins.json"
    wanted = json.dumps(VENVS[name])
    if stamp.exists() and stamp.read_text() == wanted:
        return venv / "bin"
    print(f"making {venv.relative_to(ROOT)} (pip, a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    for step in VENVS[name]:
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *step], check=True)
    stamp.write_text(wanted)
    return venv / "bin"


def _env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a peer: its own venv first on PATH, none of Switchyard's settings."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"  # torch's pool in TorchServe's worker; the model is ONNX Runtime
    env.update(extra)
    return env


def start_kserve(
    model_path: Path, tmp: Path, model: str = MODEL, tokenizer: Path | None = None
) -> Peer:
    """KServe serving ``model_path`` as ``model``; with ``tokenizer``, a sentence-embedding
    graph behind it (``peer_oip.TextEmbedder``)."""
    bin_dir = ensure_venv(".peers-venv")
    port = free_port()
    cmd = [
        "taskset",
        "-c",
        "0",
        str(bin_dir / "python"),
        str(PEERS_DIR / "kserve_server.py"),
        f"--model_path={model_path}",
        f"--model_name={model}",
        f"--http_port={port}",
    ]
    if tokenizer is not None:
        cmd.append(f"--tokenizer={tokenizer}")
    proc = Proc("kserve", cmd, _env(bin_dir, KSERVE_LOGLEVEL="WARNING"), tmp)
    label = f"KServe {version('kserve')} model server"
    return Peer(label, f"http://127.0.0.1:{port}/v2/models/{model}/infer", [proc])


def torchserve_config(store: Path, ports: tuple[int, int, int], name: str = MODEL) -> str:
    """TorchServe's config.properties: loopback only, one worker, batching 32 / 5 ms, no system
    metrics (a collector process every minute) and no token authorisation (on by default since
    0.11; Switchyard's key check is on the other side of the comparison, so this favours it)."""
    model = {
        name: {
            "1.0": {
                "defaultVersion": True,
                "marName": f"{name}.mar",
                "minWorkers": 1,
                "maxWorkers": 1,
                "batchSize": TORCHSERVE_BATCH_SIZE,
                "maxBatchDelay": TORCHSERVE_MAX_BATCH_DELAY_MS,
                "responseTimeout": 120,
            }
        }
    }
    inference, management, metrics = ports
    lines = [
        f"inference_address=http://127.0.0.1:{inference}",
        f"management_address=http://127.0.0.1:{management}",
        f"metrics_address=http://127.0.0.1:{metrics}",
        f"model_store={store}",
        f"load_models={name}.mar",
        f"models={json.dumps(model)}",
        "default_workers_per_model=1",
        "disable_system_metrics=true",
        "disable_token_authorization=true",
        "install_py_dep_per_model=false",
    ]
    return "\n".join(lines) + "\n"


def start_torchserve(
    model_path: Path, tmp: Path, model: str = MODEL, tokenizer: Path | None = None
) -> Peer:
    """TorchServe serving ``model_path`` as ``model``; with ``tokenizer`` (packed into the
    archive as tokenizer.json), a sentence-embedding graph behind it."""
    bin_dir = ensure_venv(".peers-venv")
    home = tmp / "torchserve"
    store = home / "store"
    store.mkdir(parents=True, exist_ok=True)
    extra = [str(PEERS_DIR / "peer_oip.py")]
    if tokenizer is not None:
        shutil.copy(tokenizer, home / "tokenizer.json")
        extra.append(str(home / "tokenizer.json"))
    subprocess.run(
        [
            str(bin_dir / "torch-model-archiver"),
            f"--model-name={model}",
            "--version=1.0",
            f"--serialized-file={model_path}",
            f"--handler={PEERS_DIR / 'torchserve_handler.py'}",
            f"--extra-files={','.join(extra)}",
            f"--export-path={store}",
            "--force",
        ],
        check=True,
    )
    ports = (free_port(), free_port(), free_port())
    config = home / "config.properties"
    config.write_text(torchserve_config(store, ports, model))
    cmd = [
        "taskset",
        "-c",
        "0",
        str(bin_dir / "torchserve"),
        "--foreground",  # the frontend (java) and its worker stay children, for CPU accounting
        f"--ts-config={config}",
        f"--log-config={PEERS_DIR / 'torchserve-log4j2.xml'}",
        "--ncs",  # no config snapshots written to the working directory
        "--disable-token-auth",
    ]
    logs = str(home / "logs")
    env = _env(bin_dir, LOG_LOCATION=logs, METRICS_LOCATION=logs)
    proc = Proc("torchserve", cmd, env, tmp)
    batching = f"{TORCHSERVE_BATCH_SIZE} / {TORCHSERVE_MAX_BATCH_DELAY_MS} ms"
    label = f"TorchServe {version('torchserve')}, batching {batching}"
    return Peer(label, f"http://127.0.0.1:{ports[0]}/predictions/{model}", [proc])


def start_mlserver(model_path: Path, tmp: Path) -> Peer:
    bin_dir = ensure_venv(".mlserver-venv")
    home = tmp / "mlserver"
    model_dir = home / MODEL
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in ("mlserver_runtime.py", "peer_oip.py"):
        shutil.copy(PEERS_DIR / name, model_dir / name)
    port = free_port()
    settings = {
        "http_port": port,
        "grpc_port": free_port(),
        "metrics_port": free_port(),
        "host": "127.0.0.1",
        # Inference in the server process: on one core a pool of worker processes only adds a
        # hop (its default is one worker process).
        "parallel_workers": 0,
        "metrics_endpoint": None,
        "debug": False,
    }
    (home / "settings.json").write_text(json.dumps(settings))
    model_settings = {
        "name": MODEL,
        "implementation": "mlserver_runtime.OnnxRuntimeModel",
        "parameters": {"uri": str(model_path)},
    }
    (model_dir / "model-settings.json").write_text(json.dumps(model_settings))
    cmd = ["taskset", "-c", "0", str(bin_dir / "mlserver"), "start", str(home)]
    proc = Proc("mlserver", cmd, _env(bin_dir, MLSERVER_LOGGING_LEVEL="WARNING"), tmp)
    label = f"MLServer {version('mlserver')}"
    return Peer(label, f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer", [proc])


PEERS: dict[str, Callable[..., Peer]] = {
    "kserve": start_kserve,
    "torchserve": start_torchserve,
    "mlserver": start_mlserver,
}
VENV_OF = {"kserve": ".peers-venv", "torchserve": ".peers-venv", "mlserver": ".mlserver-venv"}


def start_peer(
    name: str, model_path: Path, tmp: Path, body: str, timeout: float = 180, **options: Any
) -> Peer:
    """Start one peer and return once it answers an inference request with a 200;
    ``options`` go to its start function (``model``, ``tokenizer``)."""
    peer = PEERS[name](model_path, tmp, **options)
    try:
        wait_until(partial(_answers, peer.url, body), timeout, peer.procs[0], interval=0.5)
    except BaseException:
        peer.stop()
        raise
    return peer


def _answers(url: str, body: str) -> bool:
    try:
        reply = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and "outputs" in reply.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--setup", default="kserve,torchserve", help="peers whose venvs to make")
    args = parser.parse_args()
    for name in sorted({VENV_OF[p] for p in args.setup.split(",")}):
        print(ensure_venv(name))


if __name__ == "__main__":
    main()
