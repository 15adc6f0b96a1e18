"""The control plane with its database unreachable: every request that needs the database
answers 503 with ``Retry-After`` in its protocol's shape (the API's JSON error, an HTML page),
never a 500 with a traceback; the first failed connect opens the process's circuit, so the
requests after it fail at once instead of each waiting for a connect timeout; after the
interval one request probes, and the database is used again once it answers.

The database is a port that accepts connections and never answers, as a stalled server would
(SIGSTOP): the shared PostgreSQL is never stopped. The gateway's side of the same outage (a
lookup the database does not answer) is ``tests/test_db_stalls.py``."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from django.db import connections
from django.test import Client
from django.urls import resolve

from platform_site import postgres

CONNECT_TIMEOUT_S = 2  # libpq's least
RETRY_S = 2.0
FAST_S = 0.3  # a request refused by the open circuit, with no connect attempt (2-core box)
API, PAGE, ADMIN = "/api/v1/models", "/", "/admin/"


class StalledDatabase:
    """The default connection pointed at a listener that never answers; ``restore`` points it
    back at the test database."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)  # the kernel completes the handshakes; nobody ever answers
        self.connection = connections["default"]
        self.kept = dict(self.connection.settings_dict)
        self.connection.close()
        self.connection.settings_dict.update(
            HOST="127.0.0.1",
            PORT=str(self.listener.getsockname()[1]),
            OPTIONS={**self.kept["OPTIONS"], "connect_timeout": CONNECT_TIMEOUT_S},
        )

    def restore(self) -> None:
        self.connection.close()
        self.connection.settings_dict.update(self.kept)
        self.listener.close()
        assert self.connection.settings_dict["NAME"].startswith("test")  # never the real one


@pytest.fixture
def stalled_database(transactional_db, monkeypatch, settings):
    """Not in a test transaction (transactional_db): the test's connection is closed and
    pointed elsewhere, and back before the test database is flushed."""
    if connections["default"].vendor != "postgresql":
        pytest.skip("the circuit guards PostgreSQL connects (SQLite has none to fail)")
    settings.SWITCHYARD_DB_RETRY_S = RETRY_S
    monkeypatch.setattr(postgres, "_circuits", {})  # a circuit of the test's own, closed
    database = StalledDatabase()
    try:
        yield database
    finally:
        database.restore()
        postgres.circuit("default").succeeded()  # the flush after the test connects at once


def signed_in_client() -> Client:
    client = Client()
    client.cookies["sessionid"] = "s" * 32  # a browser's session: read from the database
    return client


def timed_get(client: Client, path: str):
    started = time.monotonic()
    response = client.get(path)
    return response, time.monotonic() - started


def assert_unavailable(response, html: bool) -> None:
    assert response.status_code == 503
    assert int(response["Retry-After"]) >= 1
    body = response.content.decode()
    assert "Traceback" not in body and "127.0.0.1" not in body
    if html:
        assert response["Content-Type"].startswith("text/html") and "unavailable" in body
    else:
        assert "unreachable" in response.json()["error"]


def test_api_pages_and_admin_answer_503_with_retry_after_and_fail_fast(stalled_database):
    for path in (API, PAGE, ADMIN):
        resolve(path)  # the URLconf's imports, out of the first request's time
    client = signed_in_client()
    first, first_s = timed_get(client, API)  # the one request that waits for a connect
    assert_unavailable(first, html=False)
    assert CONNECT_TIMEOUT_S - 0.5 < first_s < CONNECT_TIMEOUT_S + 1
    after = []
    for path, html in [(API, False), (PAGE, True), (ADMIN, True), (API, False)]:
        response, elapsed = timed_get(client, path)
        assert_unavailable(response, html)
        after.append(elapsed)
    print(f"first request {first_s:.2f} s, then {', '.join(f'{s * 1000:.1f} ms' for s in after)}")
    assert max(after) < FAST_S


def test_a_query_of_a_middleware_answers_503_too(stalled_database):
    # The Idempotency-Key middleware looks the caller up before any view runs: the answer comes
    # from the 500 handler, which the test client would otherwise raise through.
    client = signed_in_client()
    client.raise_request_exception = False
    response = client.post(API, {}, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert_unavailable(response, html=False)


def test_after_the_interval_one_request_probes_and_the_database_is_used_again(
    stalled_database,
):
    client = signed_in_client()
    assert timed_get(client, API)[0].status_code == 503  # opens the circuit
    time.sleep(RETRY_S)
    probe: list = []
    prober = threading.Thread(target=lambda: probe.append(timed_get(signed_in_client(), API)))
    prober.start()
    time.sleep(0.3)
    # While the probe waits on the stalled server, the others still fail at once.
    response, elapsed = timed_get(client, PAGE)
    assert_unavailable(response, html=True)
    assert elapsed < FAST_S
    prober.join(10)
    [(probe_response, probe_s)] = probe
    assert_unavailable(probe_response, html=False)
    assert probe_s > CONNECT_TIMEOUT_S - 0.5

    stalled_database.restore()  # the database answers again
    assert timed_get(client, PAGE)[0].status_code == 503  # still within the interval
    time.sleep(RETRY_S)
    response, _ = timed_get(client, PAGE)
    assert response.status_code == 302  # the probe connected: no such session, to the login
    assert postgres.circuit("default").available()
    assert timed_get(client, API)[0].status_code in (401, 403)
