"""Bounded front doors against a real uvicorn server, over raw sockets: headers that never
finish (or trickle in) and bodies that stop arriving or trickle in get 408 and a closed
connection, in the front door's own error shape; headers past their size get 431; a slow but
steady client and a keep-alive connection are still served; an upload past the size limit is
refused before it is read; and a 64 MB artifact upload leaves the server's memory where it was
(the upload is spooled to disk, hashed in chunks, checked in a child process and moved into
storage)."""

from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.onnx_models import padded_onnx, small_onnx

from .conftest import upload_and_promote
from .harness import Proc, create_tenant, embedded_backend, free_port, start_server

pytestmark = pytest.mark.e2e

TIMEOUT_S = 1.0
DEADLINE_S = 2.0  # a whole body, plus a second per MIN_RATE bytes received
MIN_RATE = 1000
MAX_HEADER_BYTES = 16 * 1024
MAX_ARTIFACT_BYTES = 100 * 1024 * 1024
# Peak RSS growth allowed for a 64 MB upload: the parts and buffers Django reads in (64 KB
# chunks, an 8 MB spool), not the file. Before uploads streamed, it grew by over twice the file.
UPLOAD_GROWTH_BOUND_MB = 24


class Server:
    def __init__(self, proc: Proc, port: int, key: str) -> None:
        self.proc, self.port, self.key = proc, port, key
        self.url = f"http://127.0.0.1:{port}"

    def connect(self) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return conn


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    backend = embedded_backend(tmp_path_factory.mktemp("doors"))
    backend.env.update(
        SWITCHYARD_HEADER_TIMEOUT_S=str(TIMEOUT_S),
        SWITCHYARD_BODY_TIMEOUT_S=str(TIMEOUT_S),
        SWITCHYARD_BODY_DEADLINE_S=str(DEADLINE_S),
        SWITCHYARD_BODY_MIN_RATE=str(MIN_RATE),
        SWITCHYARD_MAX_HEADER_BYTES=str(MAX_HEADER_BYTES),
        SWITCHYARD_MAX_ARTIFACT_BYTES=str(MAX_ARTIFACT_BYTES),
    )
    key = create_tenant(backend, "alpha")
    port = free_port()
    proc = start_server(backend, "uvicorn", port)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        # A model in production, so an infer request gets as far as reading its body.
        client.headers["Authorization"] = f"Bearer {key}"
        upload_and_promote(client, "clf", small_onnx())
    yield Server(proc, port, key)
    proc.stop()
    backend.close()


Answer = tuple[bytes, float]  # what the server sent until it closed, and after how long


def read_all(conn: socket.socket) -> Answer:
    """Everything the server sends until it closes the connection, and how long that took."""
    started = time.monotonic()
    got = b""
    while chunk := conn.recv(65536):
        got += chunk
    return got, time.monotonic() - started


def status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def trickle(conns: list[socket.socket], every_s: float, limit_s: float) -> list[Answer]:
    """Send each connection a space every ``every_s`` (never long enough apart for the gap
    timeout) until the server answers it; what each got, and after how long."""
    started = time.monotonic()
    answered: dict[socket.socket, Answer] = {}
    while len(answered) < len(conns) and time.monotonic() - started < limit_s:
        waiting = [c for c in conns if c not in answered]
        readable, _, _ = select.select(waiting, [], [], every_s)
        for conn in waiting:
            if conn in readable:  # the answer: read it to the close
                got, _ = read_all(conn)
                answered[conn] = (got, time.monotonic() - started)
            else:
                conn.sendall(b" ")
    return [answered.get(c, (b"", limit_s)) for c in conns]


def test_headers_that_never_finish_get_408_and_the_connection_is_closed(server):
    # A byte at a time: the header timeout runs from the connection's start, not the last byte.
    with server.connect() as conn:
        conn.sendall(b"POST /v2/models/clf/infer HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        ((raw, waited),) = trickle([conn], 0.2, TIMEOUT_S + 5)
    status, body = status_and_body(raw)
    assert status == 408 and body == {"error": "the request headers did not arrive in time"}
    assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S + 2


def test_headers_past_their_size_get_431_and_the_connection_is_closed(server):
    with server.connect() as conn:
        conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        conn.sendall(b"a" * (MAX_HEADER_BYTES + 1))
        raw, _ = read_all(conn)
    status, body = status_and_body(raw)
    assert status == 431 and body == {
        "error": f"the request headers are larger than the limit of {MAX_HEADER_BYTES} bytes"
    }


def test_a_connection_that_sends_nothing_is_closed(server):
    with server.connect() as conn:
        raw, _ = read_all(conn)
    assert raw.startswith(b"HTTP/1.1 408 ")


@pytest.mark.parametrize(
    "path, shape",
    [
        ("/v2/models/clf/infer", "platform"),
        ("/api/v1/models", "platform"),
        ("/v1/completions", "openai"),
    ],
    ids=["oip", "rest-api", "openai"],
)
def test_a_body_that_stops_arriving_gets_408_in_the_front_doors_shape(server, path, shape):
    with server.connect() as conn:
        conn.sendall(
            f"POST {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {server.key}\r\n"
            'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a":'.encode()
        )
        raw, waited = read_all(conn)
    status, body = status_and_body(raw)
    assert status == 408 and b"connection: close" in raw.lower()
    message = body["error"]["message"] if shape == "openai" else body["error"]
    assert message == f"the request body stopped arriving: no data for {TIMEOUT_S:g} s"
    if shape == "openai":
        assert body["error"]["type"] == "invalid_request_error"
    assert waited < TIMEOUT_S + 5
    assert "Traceback" not in server.proc.log()


def test_a_body_that_trickles_in_gets_408_within_the_deadline_on_every_door(server):
    doors = {  # each door's path, and whether it answers in OpenAI's shape
        "/v2/models/clf/infer": False,
        "/api/v1/models/clf/predict": False,
        "/api/v1/models": False,
        "/v1/completions": True,
        "/v1/embeddings": True,
    }
    conns = [server.connect() for _ in doors]
    for conn, path in zip(conns, doors, strict=True):
        conn.sendall(
            f"POST {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {server.key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode()
        )
    try:
        answers = trickle(conns, TIMEOUT_S * 0.3, DEADLINE_S + 5)
    finally:
        for conn in conns:
            conn.close()
    for (raw, waited), (path, openai) in zip(answers, doors.items(), strict=True):
        status, body = status_and_body(raw)
        assert status == 408 and b"connection: close" in raw.lower(), path
        message = body["error"]["message"] if openai else body["error"]
        assert message == (
            f"the request body arrived too slowly: not complete within {DEADLINE_S:g} s"
        )
        assert DEADLINE_S * 0.9 <= waited < DEADLINE_S + 2, path
    assert "Traceback" not in server.proc.log()


def test_a_slow_but_steady_client_and_a_keep_alive_connection_are_served(server):
    # Padded so that the body, at 1,000 bytes/s, takes longer than the body deadline's base:
    # what arrives extends it.
    body = json.dumps({"name": "steady", "task": "classifier"}).encode().ljust(3000)
    head = (
        f"POST /api/v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {server.key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with server.connect() as conn:
        # Each piece comes within the timeout, the whole well past it and past DEADLINE_S.
        for piece in (head[:20], head[20:], *(body[i : i + 600] for i in range(0, 3000, 600))):
            conn.sendall(piece)
            time.sleep(TIMEOUT_S * 0.6)
        created = conn.recv(65536)
        time.sleep(TIMEOUT_S * 0.6)  # idle between two requests on one connection
        conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
        live = conn.recv(65536)
    assert created.startswith(b"HTTP/1.1 201 "), created[:200]
    assert live.startswith(b"HTTP/1.1 200 ")


def test_an_upload_past_the_limit_is_413_before_it_is_read(server):
    with server.connect() as conn:
        conn.sendall(
            f"POST /api/v1/models/clf/versions HTTP/1.1\r\nHost: localhost\r\n"
            f"Authorization: Bearer {server.key}\r\nContent-Type: multipart/form-data; "
            f"boundary=b\r\nContent-Length: {MAX_ARTIFACT_BYTES * 2}\r\n\r\n".encode()
        )
        raw, _ = read_all(conn)  # answered and closed with not one byte of the body sent
    status, body = status_and_body(raw)
    assert status == 413 and "larger than the limit" in body["error"]


def rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_a_64_mb_upload_keeps_the_servers_memory_bounded(server, tmp_path):
    artifact = tmp_path / "big.onnx"
    artifact.write_bytes(padded_onnx(64))
    auth = {"Authorization": f"Bearer {server.key}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=120) as client:
        created = client.post("/api/v1/models", json={"name": "big", "task": "classifier"})
        assert created.status_code == 201, created.text
        client.get("/api/v1/models/big/versions")  # warm the view's code paths first
        pid = server.proc.popen.pid
        before = rss_kb(pid, "VmRSS")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS starts again from now
        with artifact.open("rb") as f:
            files = {"artifact": ("big.onnx", f, "application/octet-stream")}
            uploaded = client.post("/api/v1/models/big/versions", files=files)
        peak = rss_kb(pid, "VmHWM")
        too_big = client.post(
            "/api/v1/models/big/versions",
            files={"artifact": ("x.onnx", b"0" * (MAX_ARTIFACT_BYTES + 1), "application/x")},
        )
    assert uploaded.status_code == 201, uploaded.text
    version = uploaded.json()
    assert version["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    growth_mb = (peak - before) / 1024
    print(f"server peak RSS growth for a 64 MB upload: {growth_mb:.1f} MB")
    assert growth_mb < UPLOAD_GROWTH_BOUND_MB
    assert too_big.status_code == 413 and "artifact" in too_big.json()["error"]
