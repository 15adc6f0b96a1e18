"""The connection alone: a fake receiver on one side, the fake platform (or a stand-in socket)
on the other."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from serving_agent import backoff_delay, ws_url
from serving_agent._connection import Connection
from serving_agent.protocol import Heartbeat, Hello, pack_frames, unpack_frames
from tests.agent.conftest import until_stopped

if TYPE_CHECKING:
    from tests.agent.conftest import FakePlatform

pytestmark = pytest.mark.anyio

TOKEN = "node-token"


class FakeReceiver:
    """Keeps what the connection hands over, in order."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, str | bytes | None]] = asyncio.Queue()

    def handle_control(self, text: str) -> None:
        self.events.put_nowait(("control", text))

    def handle_frame(self, frame: bytes) -> None:
        self.events.put_nowait(("frame", frame))

    def disconnected(self) -> None:
        self.events.put_nowait(("disconnected", None))

    async def next(self) -> tuple[str, str | bytes | None]:
        async with asyncio.timeout(5):
            return await self.events.get()


class Recorder:
    """A stand-in for the open websocket that keeps what is sent on it."""

    def __init__(self) -> None:
        self.sent: list[str | bytes] = []

    async def send(self, message: str | bytes) -> None:
        self.sent.append(message)


async def hello() -> Hello:
    return Hello(agent_version="test", host="fake-node", cpu_count=1, memory_bytes=1)


def make_connection(
    url: str, receiver: FakeReceiver | None = None, token: str = TOKEN
) -> Connection:
    return Connection(
        ws_url(url),
        {"Authorization": f"Bearer {token}"},
        receiver or FakeReceiver(),
        hello=hello,
        heartbeat=lambda: Heartbeat(requests_total=7),
        retry_base=0.05,
        retry_cap=0.2,
        auth_retry_s=0.2,
    )


def test_ws_url_swaps_the_scheme_and_adds_the_agent_path() -> None:
    assert ws_url("http://127.0.0.1:8000") == "ws://127.0.0.1:8000/ws/agent/"
    assert ws_url("https://switchyard.example/") == "wss://switchyard.example/ws/agent/"


def test_backoff_grows_with_full_jitter_up_to_the_cap() -> None:
    for attempt, ceiling in [(0, 0.5), (1, 1.0), (3, 4.0), (10, 10.0)]:
        delays = [backoff_delay(attempt) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling / 2  # jitter spreads over the whole range


# Against the fake platform -------------------------------------------------------------------


async def test_it_says_hello_then_hands_control_messages_and_frames_to_the_receiver(
    platform: FakePlatform,
) -> None:
    receiver = FakeReceiver()
    async with until_stopped(make_connection(platform.url, receiver).run):
        hello = await platform.expect("hello")
        ws = await platform.next_connection()
        await ws.send('{"type": "assign", "versions": []}')
        await ws.send(pack_frames([b"first", b"second"]))
        events = [await receiver.next() for _ in range(3)]
    assert platform.auth_headers == [f"Bearer {TOKEN}"]
    assert hello["host"] == "fake-node"
    assert events == [
        ("control", '{"type": "assign", "versions": []}'),
        ("frame", b"first"),
        ("frame", b"second"),
    ]


async def test_heartbeats_come_from_the_callable_at_the_interval_set(
    platform: FakePlatform,
) -> None:
    connection = make_connection(platform.url)
    async with until_stopped(connection.run):
        await platform.expect("hello")
        connection.set_heartbeat_interval(0.05)  # the default 5 s sleep is cut short
        heartbeat = await platform.expect("heartbeat", timeout=2)
    assert heartbeat["requests_total"] == 7


async def test_a_dropped_connection_tells_the_receiver_and_is_opened_again(
    platform: FakePlatform,
) -> None:
    receiver = FakeReceiver()
    async with until_stopped(make_connection(platform.url, receiver).run):
        ws = await platform.next_connection()
        await platform.expect("hello")
        await ws.close(1011, "platform restarting")
        assert await receiver.next() == ("disconnected", None)
        await platform.next_connection()
        await platform.expect("hello")


async def test_a_rejected_token_is_retried(platform: FakePlatform) -> None:
    async with until_stopped(make_connection(platform.url, token="wrong").run):
        async with asyncio.timeout(5):
            while len(platform.auth_headers) < 2:
                await asyncio.sleep(0.02)
    assert platform.auth_headers[:2] == ["Bearer wrong", "Bearer wrong"]
    assert platform.messages.empty()


async def test_close_code_4401_is_retried_like_a_rejected_token(
    platform: FakePlatform, caplog: pytest.LogCaptureFixture
) -> None:
    platform.close_code = 4401
    async with until_stopped(make_connection(platform.url).run):
        await platform.next_connection()
        await platform.next_connection()
    assert "the node token is unknown or disabled" in caplog.text


async def test_stop_while_connecting_to_a_silent_host_returns_at_once() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accept the TCP connection, never answer the handshake

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = make_connection(f"http://127.0.0.1:{port}")
    async with until_stopped(connection.run, timeout=2):  # well under the 10 s handshake timeout
        await asyncio.sleep(0.1)
    server.close()


# Sending, on a stand-in socket ----------------------------------------------------------------


async def test_frames_sent_in_one_event_loop_turn_go_out_as_one_message() -> None:
    connection = make_connection("http://platform.test")
    connection.socket = socket = Recorder()
    await asyncio.gather(*(connection.send_frames([f"frame {i}".encode()]) for i in range(3)))
    await connection.send_frames([b"next turn"])
    assert [unpack_frames(m) for m in socket.sent if isinstance(m, bytes)] == [
        [b"frame 0", b"frame 1", b"frame 2"],
        [b"next turn"],
    ]


async def test_nothing_is_sent_while_disconnected() -> None:
    connection = make_connection("http://platform.test")
    await connection.send("status")
    await connection.send_frames([b"reply"])
    connection.socket = socket = Recorder()
    await connection.send_frames([b"later reply"])
    assert socket.sent == [pack_frames([b"later reply"])]


async def test_frames_of_a_stream_never_go_out_on_a_later_connection() -> None:
    connection = make_connection("http://platform.test")
    connection.socket = old = Recorder()
    send = connection.stream_sender()
    assert connection.stream_sender() is send  # one per socket: a step's frames go together
    connection.socket = new = Recorder()
    await send([b"late frame"])
    await connection.stream_sender()([b"fresh frame"])
    assert old.sent == [] and new.sent == [pack_frames([b"fresh frame"])]


def test_an_undecodable_binary_message_reaches_no_one(caplog: pytest.LogCaptureFixture) -> None:
    receiver = FakeReceiver()
    make_connection("http://platform.test", receiver).handle_message(b"\xff\xff")
    assert receiver.events.empty()
    assert "ignoring undecodable binary message" in caplog.text
