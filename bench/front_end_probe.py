"""The floor a Python HTTP front end puts under the gateway: server CPU per request of an app
that only reads a request's JSON body and answers an OIP reply's bytes
(``bench/peers/front_end_apps.py``), on uvicorn as the web command runs it (httptools, uvloop)
and on granian (its HTTP in Rust: its ASGI interface, and its own RSGI). Whatever the platform
does per request comes on top of this row, so it sizes the "compiled front end" lever of issue
33 before anyone builds it.

Each server is pinned to CPU 0, wrk (``bench/infer.lua``, the OIP body) to CPU 1; the servers
are measured in turn, ``--rounds`` times, with paired ratios against uvicorn per round. The
servers run from ``bench/.frontend-venv`` (made on first use: pip, under a minute), not the
platform's environment. Bounded: each run is ``--seconds`` long.
Run: ``.venv/bin/python bench/front_end_probe.py [--rounds 3] [--connections 1,64]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from oip_bench import BODIES, cpu_seconds, run_wrk  # noqa: E402
from peers_bench import VENVS, ensure_venv  # noqa: E402

from tests.e2e.harness import PY, Proc, free_port, wait_until  # noqa: E402

VENV = ".frontend-venv"
VENVS[VENV] = [["uvicorn==0.54.0", "httptools==0.9.0", "uvloop==0.23.0", "granian==2.8.9"]]
APPS = "front_end_apps"
APPS_DIR = ROOT / "bench" / "peers"
SERVERS = {
    "uvicorn (httptools, uvloop)": (
        "uvicorn {app}:asgi --port {port} --http httptools --loop uvloop "
        "--no-access-log --log-level warning"
    ),
    # The same app under the web command with its HTTP protocol (header and body bounds,
    # the drain, one write per reply): what the platform's own protocol layer adds.
    "uvicorn, the web command's protocol": (
        "PLATFORM -m platform_site.serve {app}:asgi --port {port} --no-access-log "
        "--log-level warning --http gateway.http_bounds:BoundedHttpProtocol"
    ),
    "granian, ASGI": (
        "granian {app}:asgi --interface asgi --port {port} --workers 1 "
        "--runtime-threads 1 --loop uvloop --log-level warning --no-ws"
    ),
    "granian, RSGI": (
        "granian {app}:rsgi --interface rsgi --port {port} --workers 1 "
        "--runtime-threads 1 --loop uvloop --log-level warning --no-ws"
    ),
}


def serve(bin_dir: Path, command: str, tmp: Path) -> tuple[Proc, str]:
    """Start one server of ``SERVERS`` on CPU 0; returns once it answers the OIP body."""
    args = command.format(app=APPS, port=free_port()).split()
    env = dict(os.environ)
    if args[0] == "PLATFORM":  # the platform's own environment and settings
        program = PY
        env["PYTHONPATH"] = str(ROOT)
        env.setdefault("DJANGO_SETTINGS_MODULE", "platform_site.settings")
    else:
        program = str(bin_dir / args[0])
    proc = Proc(args[0], ["taskset", "-c", "0", program, *args[1:]], env, tmp, cwd=APPS_DIR)
    port = args[args.index("--port") + 1]
    url = f"http://127.0.0.1:{port}/v2/models/fraud-detector/infer"
    try:
        wait_until(partial(_answers, url), 30, proc, interval=0.2)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def _answers(url: str) -> bool:
    try:
        return httpx.post(url, content=BODIES["oip"], timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", default="1,64")
    parser.add_argument("--seconds", type=int, default=5)
    args = parser.parse_args()
    bin_dir = ensure_venv(VENV)
    tmp = Path(tempfile.mkdtemp(prefix="front-end-probe-"))
    rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for name, command in SERVERS.items():
            proc, url = serve(bin_dir, command, tmp)
            try:
                for connections in (int(c) for c in args.connections.split(",")):
                    run_wrk(url, connections, 2, "", BODIES["oip"])  # warm-up
                    before = cpu_seconds(proc.popen.pid)
                    result = run_wrk(url, connections, args.seconds, "", BODIES["oip"])
                    used = cpu_seconds(proc.popen.pid) - before
                    served = max(result["requests"] - result["errors"], 1)
                    rate = served / (result["duration_us"] / 1e6)
                    rows.setdefault((name, connections), []).append(
                        (rate, result["p99_us"] / 1000, used / served * 1e6)
                    )
            finally:
                proc.stop()
    print(f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.rounds} rounds:\n")
    print("| server | connections | req/s | p99 ms | server CPU µs/req | CPU / uvicorn's |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = next(iter(SERVERS))
    for (name, connections), runs in rows.items():
        own = [cpu for _, _, cpu in runs]
        ratios = [c / b for c, (_, _, b) in zip(own, rows[(base, connections)], strict=True)]
        print(
            f"| {name} | {connections} | {statistics.median(r for r, _, _ in runs):,.0f} "
            f"| {statistics.median(p for _, p, _ in runs):.2f} | {statistics.median(own):.1f} "
            f"| {statistics.median(ratios):.2f} |"
        )


if __name__ == "__main__":
    main()
