"""The storage-stall drill, shared by its test (``test_predlog_stall.py``) and its re-runnable
report (``bench/drill_storage_stall.py``): a real uvicorn server and agent answer OIP v2
requests of a model logging every one (100 % sampling) to the Parquet log on S3 (moto's S3
server in a process of its own) while that server is stopped (SIGSTOP) for ``stall_s`` and then
resumed; afterwards every 2xx answer must have its log row in the files exactly once, matched
by the request id the client sent.

A stopped server accepts connections and never answers: the writer's requests time out
(``SWITCHYARD_LOG_S3_TIMEOUT_S``), the batch stays in the buffer and is written again, each file
under the name it was first given, so a write the server finishes late is replaced, not doubled.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from tests.onnx_models import small_onnx
from tests.s3_server import REGION, s3_server_process

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import create_node, create_tenant, free_port, start_agent, start_server

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1] * 4}]}
METRICS_TOKEN = "drill-scrape-token"
STALL_SEED = (("node", "n"), ("tenant", "alpha", 100_000, 100_000))
LOG_EVERY_REQUEST = """
from registry.models import Model
m = Model.objects.get(name="clf")
m.log_sample_rate = 1.0
m.save()
"""


@dataclass
class StallResult:
    stall_s: float
    sent: int = 0
    ok: int = 0
    failed: int = 0
    during_stall: int = 0
    lost: int = 0  # 2xx answers without a row in the log's files
    doubled: int = 0  # request ids with more than one row
    recover_s: float = 0.0
    retries: float = 0.0
    dropped: dict[str, float] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)

    def table(self) -> str:
        dropped = ", ".join(f"{k} {v:g}" for k, v in sorted(self.dropped.items())) or "none"
        rows = [
            ("what was broken", f"the log's S3 server stopped (SIGSTOP) {self.stall_s:g} s"),
            ("requests sent", f"{self.sent} ({self.during_stall} during the stall)"),
            ("failed (non-2xx or no answer)", str(self.failed)),
            ("2xx without a log row (lost)", str(self.lost)),
            ("rows written twice", str(self.doubled)),
            ("writer: batches retried", f"{self.retries:g}"),
            ("writer: records dropped", dropped),
            ("time to recover (resume → every row written)", f"{self.recover_s:.2f} s"),
        ]
        lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]
        return "\n".join(lines)


def run_storage_stall_drill(
    tmp: Path,
    *,
    backend_name: str = "embedded",
    stall_s: float = 5.0,
    before_s: float = 2.0,
    after_s: float = 2.0,
    clients: int = 4,
    catch_up_s: float = 60.0,
) -> StallResult:
    """Start moto's S3 server, a platform logging to it, an agent; load them with ``clients``
    sequential clients, stop the S3 server for ``stall_s`` in the middle, then wait for the log
    to catch up and count what it lost or doubled."""
    with s3_server_process() as (s3, s3_pid):
        bucket = s3.new_bucket()
        backend = make_backend(backend_name, tmp, STALL_SEED)
        backend.env.update(s3.env(bucket))
        backend.env.update(
            {
                "SWITCHYARD_METRICS_TOKEN": METRICS_TOKEN,
                "SWITCHYARD_PREDLOG_FLUSH_S": "0.2",
                "SWITCHYARD_LOG_S3_TIMEOUT_S": "1",
            }
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs = [start_server(backend, "uvicorn", port)]
        try:
            procs.append(start_agent(backend, url, create_node(backend, "n")))
            key = create_tenant(backend, "alpha", rps=100_000, burst=100_000)
            headers = {"Authorization": f"Bearer {key}"}
            with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
                created = client.post("/api/v1/models", json={"name": "clf", "task": "classifier"})
                assert created.status_code == 201, created.text
                backend.shell(LOG_EVERY_REQUEST)
                upload_and_promote(client, "clf", small_onnx())
                wait_ready(client, "clf", proc=procs[-1])
            files = LogFiles(s3.endpoint, bucket)
            return _drill(
                url, headers, s3_pid, files, stall_s, before_s, after_s, clients, catch_up_s
            )
        finally:
            for proc in reversed(procs):
                proc.stop()
            backend.close()


class LogFiles:
    """The Parquet log's request ids, read straight from the bucket (as Spark would)."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        parsed = urlparse(endpoint)
        self.fs = pafs.S3FileSystem(
            endpoint_override=parsed.netloc,
            scheme=parsed.scheme,
            region=REGION,
            access_key=os.environ["AWS_ACCESS_KEY_ID"],
            secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            request_timeout=5,
        )
        self.root = f"{bucket}/logs/predictions"

    def request_ids(self, prefix: str) -> Counter[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, recursive=True))
        found: Counter[str] = Counter()
        for info in infos:
            if info.type == pafs.FileType.File and info.path.endswith(".parquet"):
                ids = pq.read_table(info.path, filesystem=self.fs, columns=["request_id"])
                found.update(r for r in ids["request_id"].to_pylist() if r.startswith(prefix))
        return found


def _drill(
    url: str,
    headers: dict[str, str],
    s3_pid: int,
    files: LogFiles,
    stall_s: float,
    before_s: float,
    after_s: float,
    clients: int,
    catch_up_s: float,
) -> StallResult:
    stop = threading.Event()
    answers: list[tuple[str, float, int]] = []  # (request id, sent at, status; 0: no answer)
    prefix = f"stall-{uuid.uuid4().hex[:8]}-"

    def load(worker: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            i = 0
            while not stop.is_set():
                request_id = f"{prefix}{worker}-{i}"
                sent_at = time.monotonic()
                try:
                    r = c.post(
                        "/v2/models/clf/infer", json=BODY, headers={"x-request-id": request_id}
                    )
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                answers.append((request_id, sent_at, status))
                i += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(clients)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(before_s)
        os.kill(s3_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            time.sleep(stall_s)
        finally:
            os.kill(s3_pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        answered = {rid for rid, _, status in list(answers) if 200 <= status < 300}
        _wait_logged(files, prefix, answered, catch_up_s)
        recover_s = time.monotonic() - resumed_at
        time.sleep(max(0.0, after_s - recover_s))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)

    result = StallResult(stall_s=stall_s, sent=len(answers))
    for _, _, status in answers:
        result.statuses[status] = result.statuses.get(status, 0) + 1
    ok = {rid for rid, _, status in answers if 200 <= status < 300}
    result.ok = len(ok)
    result.failed = result.sent - result.ok
    result.during_stall = sum(1 for _, at, _ in answers if stopped_at <= at < resumed_at)
    result.lost = len(_wait_logged(files, prefix, ok, catch_up_s))
    counts = files.request_ids(prefix)
    result.doubled = sum(1 for n in counts.values() if n > 1)
    result.recover_s = recover_s
    result.dropped, result.retries = log_counters(url)
    return result


def _wait_logged(files: LogFiles, prefix: str, request_ids: set[str], timeout: float) -> set[str]:
    """Wait until each of ``request_ids`` has its row in the files; returns those missing."""
    missing = set(request_ids)
    deadline = time.monotonic() + timeout
    while missing:
        missing -= set(files.request_ids(prefix))
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return missing


def log_counters(url: str) -> tuple[dict[str, float], float]:
    """The writer's drops by reason and its retried batches, from ``/metrics``."""
    auth = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    text = httpx.get(f"{url}/metrics", headers=auth, timeout=30).text
    found = re.findall(
        r'^switchyard_prediction_log_records_total\{outcome="dropped_(\w+)"\} (\S+)$', text, re.M
    )
    retried = re.search(r"^switchyard_prediction_log_write_retries_total (\S+)$", text, re.M)
    return {reason: float(n) for reason, n in found}, float(retried.group(1)) if retried else 0.0
