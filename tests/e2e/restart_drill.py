"""The restart drill: the web tier restarted and its workers stopped or killed under load, with
`make up`'s supervision (deploy/supervisord.conf) and two uvicorn workers. Shared by
tests/e2e/test_restart_drill.py (which asserts on it) and bench/drill_restarts.py (which prints
its table).

Each request's outcome is one of: answered 200; answered with another status (a refusal the
client can act on: 503 with Retry-After); refused (the connection was never accepted, so the
client knows nothing was done); or lost (the connection was accepted, or an idle keep-alive one
used, and closed without an answer: the client cannot tell whether its request ran). Prediction
log rows are counted against the 200s (every prediction is logged: sample rate 1).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.onnx_models import small_onnx

from .harness import Backend, answers, create_node, create_tenant, free_port, wait_until
from .supervision_drill import PROGRAMS, Supervised

CONCURRENCY = 8  # client threads, each on its own keep-alive connection
INFER_BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.5] * 4}]}
REFUSED, LOST = -1, 0  # outcome codes besides HTTP statuses
PAUSE_S = 0.01  # between one thread's requests: load below the tenant's rate limit
STEADY_S = 2.0  # load watched before each fault and after each recovery
DRILL_SEED = (("tenant", "drill"), ("node", "supervised"))


@dataclass
class Load:
    """Client threads sending OIP v2 infer requests until stopped, each outcome kept. Like
    most HTTP clients, each keeps its connection alive between requests and does not send a
    POST again after a connection failure (it cannot know whether the first one ran)."""

    url: str
    key: str
    concurrency: int = CONCURRENCY
    outcomes: list[tuple[float, int]] = field(default_factory=list)
    said: dict[int, str] = field(default_factory=dict)  # per status, the first answer's body
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(self.concurrency):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=20) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    reply = client.post("/v2/models/clf/infer", json=INFER_BODY)
                except httpx.ConnectError:
                    status = REFUSED
                    time.sleep(0.1)  # a client backs off a refused connection
                except httpx.HTTPError as exc:
                    status = LOST
                    self.said.setdefault(LOST, repr(exc))
                else:
                    status = reply.status_code
                    if status != 200:
                        self.said.setdefault(status, reply.text[:300])
                        # As a client should: wait as told (at most a second here) before trying
                        # again, rather than spin on refusals.
                        time.sleep(min(1.0, float(reply.headers.get("Retry-After", "0.1"))))
                self.outcomes.append((started, status))  # list.append is atomic
                time.sleep(PAUSE_S)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def between(self, start: float, end: float) -> list[int]:
        return [status for at, status in list(self.outcomes) if start <= at < end]


@dataclass
class Row:
    fault: str
    sent: int
    ok: int
    answered_other: int  # an HTTP answer other than 200 (e.g. 503 with Retry-After)
    refused: int
    lost: int
    recover_s: float  # from the fault until requests succeed again
    statuses: dict[int, int]

    @staticmethod
    def of(fault: str, outcomes: list[int], recover_s: float) -> Row:
        statuses: dict[int, int] = {}
        for status in outcomes:
            statuses[status] = statuses.get(status, 0) + 1
        return Row(
            fault=fault,
            sent=len(outcomes),
            ok=statuses.get(200, 0),
            answered_other=sum(n for s, n in statuses.items() if s > 0 and s != 200),
            refused=statuses.get(REFUSED, 0),
            lost=statuses.get(LOST, 0),
            recover_s=recover_s,
            statuses=statuses,
        )


@dataclass
class Result:
    rows: list[Row]
    answered_200: int  # over the whole drill
    log_rows: int  # prediction-log rows written for the drill's model, status 200
    said: dict[int, str]

    @property
    def log_rows_lost(self) -> int:
        return max(0, self.answered_200 - self.log_rows)


def _children(pid: int) -> list[int]:
    """The worker processes uvicorn's supervisor runs: its children started by
    multiprocessing's spawn (not its resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as listed:
        children = [int(child) for child in listed.read().split()]
    workers = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                if b"spawn_main" in cmdline.read():
                    workers.append(child)
        except FileNotFoundError:  # it just exited
            pass
    return workers


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _tcp_ports() -> dict[int, tuple[int, int]]:
    """Socket inode -> (local port, remote port) of every IPv4 TCP socket on this machine."""
    found = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], int(fields[9])
        found[inode] = (int(local.split(":")[1], 16), int(remote.split(":")[1], 16))
    return found


def holder_of_agent(workers: list[int], agent_pid: int, port: int) -> int | None:
    """The web worker that holds the agent's main connection (to the HTTP port; its data
    links go to each worker's own link port), None while it has none."""
    ports = _tcp_ports()
    agent_side = {ports[i][0] for i in _socket_inodes(agent_pid) if ports.get(i, (0, 0))[1] == port}
    for worker in workers:
        for inode in _socket_inodes(worker):
            local, remote = ports.get(inode, (0, 0))
            if local == port and remote in agent_side:
                return worker
    return None


def _serve_model(url: str, key: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        body = {"name": "clf", "task": "classifier", "log_sample_rate": 1.0}
        created = client.post("/api/v1/models", json=body)
        assert created.status_code == 201, created.text
        files = {"artifact": ("model.onnx", small_onnx(), "application/octet-stream")}
        version = client.post("/api/v1/models/clf/versions", files=files)
        assert version.status_code == 201, version.text
        number = version.json()["version"]
        moved = client.put("/api/v1/models/clf/aliases/production", json={"version": number})
        assert moved.status_code == 200, moved.text


def _serving(url: str, key: str) -> bool:
    try:
        reply = httpx.post(
            f"{url}/v2/models/clf/infer",
            json=INFER_BODY,
            headers={"Authorization": f"Bearer {key}"},
            timeout=5,
        )
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def run_drill(
    backend: Backend, say: Callable[[str], None] = lambda _: None, steady_s: float = STEADY_S
) -> Result:
    """Under load: restart the web program (supervisorctl restart), stop one of its two
    workers (SIGTERM), kill one (SIGKILL); each recovery measured until every client gets 200s
    again, then ``steady_s`` of load."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    key = create_tenant(backend, "drill")
    (backend.var_dir / "node-token").write_text(create_node(backend, "supervised"))
    supervised = Supervised(backend, port, web_workers=2)
    load = Load(url, key)
    rows: list[Row] = []
    try:
        wait_until(lambda: answers(url), 90, supervised.proc)
        wait_until(lambda: all(supervised.running(p) for p in PROGRAMS), 60, supervised.proc)
        _serve_model(url, key)
        wait_until(lambda: _serving(url, key), 90, supervised.proc, interval=0.5)
        say("platform up under supervisord with two web workers, model ready")
        load.start()
        time.sleep(steady_s)
        faults: list[tuple[str, Callable[[], None]]] = [
            ("web restarted (supervisorctl restart web)", lambda: _restart_web(supervised)),
            (
                "one web worker stopped (SIGTERM)",
                lambda: _stop_worker(supervised, port, TERM),
            ),
            (
                "one web worker killed (SIGKILL)",
                lambda: _stop_worker(supervised, port, KILL),
            ),
        ]
        for name, fault in faults:
            rows.append(_fault_and_recover(load, name, fault, steady_s))
            say(f"{name}: recovered in {rows[-1].recover_s:.1f} s")
        load.stop()
        time.sleep(3)  # the writers flush every second
        answered = sum(status == 200 for _, status in load.outcomes)
        logged = [(logged_ok(backend),)]
    finally:
        load.stop()
        supervised.stop()  # whatever failed: no platform is left running
    return Result(rows, answered, int(logged[0][0]), load.said)


def _restart_web(supervised: Supervised) -> None:
    """What `supervisorctl restart web` does: stop (SIGTERM to the group, then wait), start."""
    supervised.rpc.supervisor.stopProcess("web")
    supervised.rpc.supervisor.startProcess("web")


TERM, KILL = signal.SIGTERM, signal.SIGKILL


def _stop_worker(supervised: Supervised, port: int, sig: signal.Signals) -> None:
    """Signal the web worker that holds the agent's main connection (the worst one to lose);
    return once uvicorn's supervisor has started one in its place and the agent has a data
    link to it (so the next fault finds two serving workers)."""
    agent = supervised.info("agent")["pid"]
    workers = wait_until(lambda: _two(supervised), 60)
    worker = wait_until(lambda: holder_of_agent(workers, agent, port), 30)
    links_before = _log_count(supervised, "data link for session")
    os.kill(worker, sig)
    wait_until(lambda: worker not in (_two(supervised) or [worker]), 60)
    wait_until(lambda: _log_count(supervised, "data link for session") > links_before, 90)


def _two(supervised: Supervised) -> list[int] | None:
    workers = _children(supervised.info("web")["pid"])
    return workers if len(workers) == 2 else None


def _log_count(supervised: Supervised, line: str) -> int:
    return supervised.proc.log_path.read_bytes().count(line.encode())


def _fault_and_recover(load: Load, name: str, fault: Callable[[], None], steady_s: float) -> Row:
    started = time.monotonic()
    fault()

    def recovered() -> bool:
        # Every client thread's latest request, begun after the fault, was answered 200.
        latest = [s for at, s in list(load.outcomes)[-load.concurrency * 2 :] if at > started]
        return len(latest) >= load.concurrency and all(s == 200 for s in latest)

    wait_until(recovered, 120, interval=0.1)
    recovered_at = time.monotonic()
    time.sleep(steady_s)
    return Row.of(name, load.between(started, time.monotonic()), recovered_at - started)


def table(result: Result) -> str:
    lines = [
        "| fault | requests sent | 200 | other answers | refused | lost | recovered (s) "
        "| statuses |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result.rows:
        statuses = ", ".join(
            f"{'refused' if s == REFUSED else 'lost' if s == LOST else s}: {n}"
            for s, n in sorted(r.statuses.items())
        )
        lines.append(
            f"| {r.fault} | {r.sent} | {r.ok} | {r.answered_other} | {r.refused} | {r.lost} "
            f"| {r.recover_s:.1f} | {statuses} |"
        )
    lines.append("")
    lines.append(
        f"Answered 200 over the drill: {result.answered_200}; prediction-log rows: "
        f"{result.log_rows}; lost: {result.log_rows_lost}."
    )
    for status, body in sorted(result.said.items()):
        lines.append(f"- first {'lost' if status == LOST else status}: {body}")
    return "\n".join(lines)


def logged_ok(backend: Backend) -> int:
    """Successful requests in the backend's Parquet prediction log (its local log directory)."""
    import pyarrow.dataset as pads

    root = backend.var_dir / "media" / "logs" / "predictions"
    if not root.exists():
        return 0
    files = [str(p) for p in root.rglob("*.parquet") if not p.name.startswith(".")]
    if not files:
        return 0
    table = pads.dataset(files, format="parquet").to_table(columns=["status"])
    return int(sum(1 for status in table["status"].to_pylist() if status == 200))
