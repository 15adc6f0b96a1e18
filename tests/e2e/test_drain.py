"""A web process's SIGTERM loses no request it accepted (gateway/drain.py, platform_site/serve.py):
clients on kept-alive connections sending throughout are answered or refused a new connection,
never left without an answer; a request whose body is still arriving is answered. One process,
and uvicorn's ``--workers 2`` through platform_site.serve (whose parent stops listening at once).
The whole platform under supervision, with agents, is bench/drill_restarts.py."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

from .conftest import make_backend
from .harness import PY, Proc, answers, free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.serial]

CLIENTS = 4


def _server(backend, port: int, workers: int) -> Proc:
    args = [PY, "-m", "platform_site.serve", "platform_site.asgi:application"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--no-access-log"]
    args += ["--http", "gateway.http_bounds:BoundedHttpProtocol", "--workers", str(workers)]
    proc = Proc("web", args, backend.env, backend.var_dir)
    wait_until(lambda: answers(f"http://127.0.0.1:{port}"), 60, proc)
    return proc


def _slow_request(port: int, result: dict[str, bytes]) -> None:
    """A POST whose body's second half comes 1 s after the first (SIGTERM falls between)."""
    body = b'{"inputs": []}'
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(
            b"POST /v2/models/none/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body[:5])
        )
        time.sleep(1.0)
        sock.sendall(body[5:])
        result["answer"] = sock.recv(65536)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_answers_every_accepted_request(tmp_path, workers):
    backend = make_backend("embedded", tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _server(backend, port, workers)
    outcomes: list[str] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=20) as http:
            while not stop.is_set():
                try:
                    outcomes.append(str(http.get("/v2/health/live").status_code))
                except httpx.ConnectError:
                    outcomes.append("refused")  # never accepted: nothing was sent
                    time.sleep(0.05)
                except httpx.HTTPError as exc:
                    outcomes.append(f"lost: {exc!r}")
                time.sleep(0.005)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    slow: dict[str, bytes] = {}
    slow_thread = threading.Thread(target=_slow_request, args=(port, slow))
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        slow_thread.start()
        time.sleep(0.3)  # its headers and half its body are in
        os.killpg(server.popen.pid, signal.SIGTERM)  # as supervisord's stopasgroup does
        server.popen.wait(30)
        time.sleep(0.5)  # the clients now find nothing listening
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        slow_thread.join(30)
        server.stop()
        backend.close()
    lost = [o for o in outcomes if o.startswith("lost")]
    assert not lost, lost
    assert "refused" in outcomes and outcomes.count("200") > 10, outcomes
    # The request in flight at SIGTERM got its answer (a 4xx: no such model) before the exit.
    assert slow.get("answer", b"").startswith(b"HTTP/1.1 4"), slow
