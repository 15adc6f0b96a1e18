"""Memory of the web server during artifact uploads: peak and resident RSS growth of one uvicorn
process (embedded default) for uploads of a valid ONNX model of a given size.

    .venv/bin/python bench/upload_memory.py [--mb 400] [--count 2]

Prints one Markdown table row. Run from the repository root; to compare with an older tree,
run the same script from that tree's root (``git archive <commit> | tar -x -C /tmp/old``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path.cwd()))

from tests.e2e.harness import (  # noqa: E402
    create_tenant,
    embedded_backend,
    free_port,
    start_server,
)
from tests.onnx_models import padded_onnx  # noqa: E402


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=400, help="size of each artifact, in MB")
    parser.add_argument("--count", type=int, default=2, help="uploads, one after the other")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sy-upload-bench-") as tmp:
        backend = embedded_backend(Path(tmp))
        key = create_tenant(backend, "bench")
        port = free_port()
        server = start_server(backend, "uvicorn", port)
        artifact = Path(tmp) / "model.onnx"
        artifact.write_bytes(padded_onnx(args.mb))
        try:
            url = f"http://127.0.0.1:{port}"
            auth = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=auth, timeout=600) as client:
                client.post("/api/v1/models", json={"name": "big", "task": "classifier"})
                client.get("/api/v1/models/big/versions")
                pid = server.popen.pid
                before = status_kb(pid, "VmRSS")
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS counts from now
                started = time.perf_counter()
                for _ in range(args.count):
                    with artifact.open("rb") as f:
                        files = {"artifact": ("model.onnx", f, "application/octet-stream")}
                        answer = client.post("/api/v1/models/big/versions", files=files)
                    answer.raise_for_status()
                seconds = time.perf_counter() - started
                after, peak = status_kb(pid, "VmRSS"), status_kb(pid, "VmHWM")
        finally:
            server.stop()
            backend.close()
    print(
        f"| {args.count} x {args.mb} MB | {(peak - before) / 1024:.0f} MB "
        f"| {(after - before) / 1024:.0f} MB | {seconds / args.count:.1f} s |"
    )


if __name__ == "__main__":
    main()
