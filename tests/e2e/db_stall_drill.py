"""The PostgreSQL-stall drill, shared by its test (``test_predlog_stall.py``) and its re-runnable
report (``bench/drill_db_stall.py``): a real uvicorn server and agent answer OIP v2 requests of
a model logging every one (100 % sampling) while another connection holds an ACCESS EXCLUSIVE
lock on the prediction log's table for ``stall_s``; afterwards every 2xx answer must have its
log row, matched by the request id the client sent.

The lock stalls exactly what the drill is about (the log's writes) on the shared PostgreSQL
server, which is never stopped or paused: other sessions and databases are untouched.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx
import psycopg

from tests.onnx_models import small_onnx

from .conftest import upload_and_promote, wait_ready
from .harness import Backend, create_node, create_tenant, free_port, start_agent, start_server

LOG_TABLE = "gateway_predictionlog"
BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1] * 4}]}
METRICS_TOKEN = "drill-scrape-token"
LOG_EVERY_REQUEST = """
from registry.models import Model
m = Model.objects.get(name="clf")
m.log_sample_rate = 1.0
m.save()  # save(), not update(): the change signal drops the gateway's cached route
"""
# The rows run_stall_drill needs on the backend it is given (make_backend's seed).
STALL_SEED = (("node", "n"), ("tenant", "alpha", 100_000, 100_000))


@dataclass
class StallResult:
    """What the drill saw. ``lost`` is the 2xx answers without a log row: it must be 0."""

    stall_s: float
    sent: int = 0
    ok: int = 0  # 2xx
    failed: int = 0  # any other status, or no answer
    during_stall: int = 0  # answers to requests sent while the table was locked
    lost: int = 0
    dropped: dict[str, float] = field(default_factory=dict)  # the writer's counters, by reason
    retries: float = 0.0  # batches the database refused for the lock, kept and retried
    recover_s: float = 0.0  # from the lock's release until every 2xx had its row
    statuses: dict[int, int] = field(default_factory=dict)

    def table(self) -> str:
        """The drill as a Markdown table, as docs/reliability.md records it."""
        dropped = ", ".join(f"{k} {v:g}" for k, v in sorted(self.dropped.items())) or "none"
        rows = [
            (
                "what was broken",
                f"prediction-log table locked (ACCESS EXCLUSIVE) {self.stall_s:g} s",
            ),
            ("requests sent", f"{self.sent} ({self.during_stall} during the stall)"),
            ("failed (non-2xx or no answer)", str(self.failed)),
            ("degraded", "0 (no answer depends on the log)"),
            ("2xx without a log row (lost)", str(self.lost)),
            ("writer: batches retried", f"{self.retries:g}"),
            ("writer: records dropped", dropped),
            ("time to recover (unlock → every row written)", f"{self.recover_s:.2f} s"),
        ]
        lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]
        return "\n".join(lines)


def prepare(backend: Backend) -> None:
    """Settings the drill needs from the platform it starts."""
    backend.env["SWITCHYARD_METRICS_TOKEN"] = METRICS_TOKEN


def run_stall_drill(
    backend: Backend,
    *,
    stall_s: float = 5.0,
    before_s: float = 2.0,
    after_s: float = 2.0,
    clients: int = 4,
    catch_up_s: float = 60.0,
) -> StallResult:
    """Start a server and an agent on ``backend`` (PostgreSQL), load them with ``clients``
    sequential clients, stall the log table for ``stall_s`` in the middle, then wait for the
    log to catch up and count what it lost."""
    prepare(backend)
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
        return _drill(backend, url, headers, stall_s, before_s, after_s, clients, catch_up_s)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _drill(
    backend: Backend,
    url: str,
    headers: dict[str, str],
    stall_s: float,
    before_s: float,
    after_s: float,
    clients: int,
    catch_up_s: float,
) -> StallResult:
    stop = threading.Event()
    answers: list[tuple[str, float, int]] = []  # (request id, sent at, status; 0: no answer)
    run = uuid.uuid4().hex[:8]

    def load(worker: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            i = 0
            while not stop.is_set():
                request_id = f"stall-{run}-{worker}-{i}"
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
        with psycopg.connect(backend.env["DATABASE_URL"]) as locker:
            locker.execute(f"LOCK TABLE {LOG_TABLE} IN ACCESS EXCLUSIVE MODE")
            locked_at = time.monotonic()
            time.sleep(stall_s)
            locker.rollback()
        unlocked_at = time.monotonic()
        # Recovered once every request answered before the unlock has its row.
        answered = {rid for rid, _, status in list(answers) if 200 <= status < 300}
        _wait_logged(backend, run, answered, catch_up_s)
        recover_s = time.monotonic() - unlocked_at
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
    result.during_stall = sum(1 for _, at, _ in answers if locked_at <= at < unlocked_at)

    result.lost = len(_wait_logged(backend, run, ok, catch_up_s))
    result.recover_s = recover_s
    result.dropped, result.retries = log_counters(url)
    return result


def _wait_logged(backend: Backend, run: str, request_ids: set[str], timeout: float) -> set[str]:
    """Wait until each of ``request_ids`` has its log row; returns those still missing."""
    missing = set(request_ids)
    deadline = time.monotonic() + timeout
    while missing:
        logged = backend.query(
            f"SELECT request_id FROM {LOG_TABLE} WHERE request_id LIKE ?", (f"stall-{run}-%",)
        )
        missing -= {rid for (rid,) in logged}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.05)
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
