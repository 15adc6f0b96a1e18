"""The agent's websocket to the platform: connect and reconnect with backoff, say hello, hand
what arrives to a receiver, send replies coalesced per event-loop turn, and send heartbeats."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from .protocol import (
    AGENT_WS_PATH,
    CLOSE_CLAIM_REFUSED,
    CLOSE_UNAUTHORIZED,
    Attach,
    Heartbeat,
    Hello,
    pack_frames,
    unpack_frames,
)

if TYPE_CHECKING:
    from ._streaming import SendFrames

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def ws_url(platform: str) -> str:
    """The agent websocket URL for a platform base URL (http -> ws, https -> wss)."""
    base = platform.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if base.startswith(http):
            base = ws + base.removeprefix(http)
    return base + AGENT_WS_PATH


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 10.0) -> float:
    """Exponential backoff with full jitter, so a fleet of agents does not reconnect in step."""
    return random.uniform(0, min(cap, base * 2**attempt))


# Close codes a platform process sends when it stops (1012 service restart: uvicorn's shutdown;
# 1001 going away): it, or another process behind the same address, is back within seconds.
# For RESTART_WINDOW_S after one the backoff is capped at RESTART_RETRY_CAP_S, so the agent is
# not asleep in a long backoff, grown while the address refused, when the new process starts
# (requests then wait on a cold start for nothing). The jitter still spreads a fleet.
RESTART_CODES = (1001, 1012)
RESTART_WINDOW_S = 60.0
RESTART_RETRY_CAP_S = 1.0


class AuthRejected(Exception):
    """The platform refused this agent: its node token (HTTP 401/403, close code 4401), or a
    claim beyond what its node may serve (close code 4403). Retried only slowly."""


# Why the platform closed the socket, for the codes that mean "do not simply reconnect".
REFUSALS = {
    CLOSE_UNAUTHORIZED: "the node token is unknown or disabled; check --token",
    CLOSE_CLAIM_REFUSED: "it claimed a deployment, version or session its node may not serve; "
    "check --deployment and the node's tenant",
}


class Socket(Protocol):
    """An open websocket, as far as sending goes."""

    async def send(self, message: str | bytes) -> None: ...


class Receiver(Protocol):
    """What a connection hands the platform's messages to. Each call returns at once, so the
    reader keeps reading; the work it starts answers through ``Connection.send_frames``."""

    def handle_control(self, text: str) -> None:
        """A JSON control message."""

    def handle_frame(self, frame: bytes) -> None:
        """One binary frame of a message (a message may carry several)."""

    def disconnected(self) -> None:
        """The connection closed: whatever is sent from now on goes nowhere."""


class Connection:
    """One websocket to the platform at a time, reopened until ``stop`` is set.

    It knows nothing of versions or requests: messages go to ``receiver``; the hello and each
    heartbeat come from the callables it is given.
    """

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        receiver: Receiver,
        *,
        hello: Callable[[], Awaitable[Hello | Attach]],
        heartbeat: Callable[[], Heartbeat] | None,
        retry_base: float = 0.5,
        retry_cap: float = 10.0,
        auth_retry_s: float = 60.0,
        stable_s: float = 10.0,
    ) -> None:
        self.url = url
        self.headers = headers
        self.receiver = receiver
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.auth_retry_s = auth_retry_s
        self.stable_s = stable_s  # a connection up this long resets the backoff
        self.heartbeat_s = 5.0
        self.socket: Socket | None = None  # the open websocket; None while disconnected
        self.close_code: int | None = None  # the platform's close code of the last connection
        self._hello = hello
        self._heartbeat = heartbeat
        self._heartbeats: asyncio.Task[None] | None = None
        self._outbox: list[bytes] = []
        self._stream_sender: tuple[Socket | None, SendFrames] | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Connect and serve until ``stop`` is set, reconnecting with backoff."""
        loop = asyncio.get_running_loop()
        attempt = 0
        restart_until = 0.0  # the platform said it restarts: retry often until then
        while not stop.is_set():
            started = loop.time()
            delay = None
            try:
                await self.connect_and_serve(stop)
            except AuthRejected as exc:
                logger.error("the platform refused this agent: %s", exc)
                delay = random.uniform(self.auth_retry_s / 2, self.auth_retry_s)
            except ConnectionClosed as exc:
                logger.warning("connection lost: %s", exc)
            except (OSError, TimeoutError, WebSocketException) as exc:
                logger.warning("cannot reach %s: %s", self.url, exc)
            except Exception:
                logger.exception("connection failed unexpectedly")  # keep the node serving
            if stop.is_set():
                break
            if self.close_code in RESTART_CODES:
                restart_until = loop.time() + RESTART_WINDOW_S
            self.close_code = None
            if loop.time() - started >= self.stable_s:
                attempt = 0
            if delay is None:
                cap = self.retry_cap
                if loop.time() < restart_until:
                    cap = min(cap, RESTART_RETRY_CAP_S)
                delay = backoff_delay(attempt, self.retry_base, cap)
                attempt += 1
            logger.info("reconnecting in %.2f s", delay)
            try:
                async with asyncio.timeout(delay):
                    await stop.wait()
            except TimeoutError:
                pass

    async def connect_and_serve(self, stop: asyncio.Event) -> None:
        """One connection: open it, serve it until it closes or ``stop`` is set."""
        try:
            ws = await self.open(stop)
            if ws is None:
                return
            async with ws:
                logger.info("connected to %s", self.url)
                await self.serve(ws, stop)
        except InvalidStatus as exc:
            if exc.response.status_code in (401, 403):
                raise AuthRejected(
                    f"HTTP {exc.response.status_code}: {REFUSALS[CLOSE_UNAUTHORIZED]}"
                ) from exc
            raise
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code in REFUSALS:
                code = exc.rcvd.code
                raise AuthRejected(f"close code {code}: {REFUSALS[code]}") from exc
            raise

    async def open(self, stop: asyncio.Event) -> ClientConnection | None:
        """Open the websocket, or None if ``stop`` is set first (a dead host can take seconds)."""
        opening = asyncio.create_task(self._connect())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({opening, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not opening.done():
            opening.cancel()
            return None
        return opening.result()

    async def _connect(self) -> ClientConnection:
        return await connect(
            self.url,
            additional_headers=self.headers,
            max_size=MAX_MESSAGE_BYTES,
            compression=None,  # deflate would cost CPU on every inference frame
        )

    async def serve(self, ws: ClientConnection, stop: asyncio.Event) -> None:
        """Say hello, then hand messages to the receiver until the connection closes."""
        await ws.send((await self._hello()).model_dump_json())
        self.socket = ws
        if self._heartbeat is not None:  # a data link sends none: its main connection does
            self._heartbeats = asyncio.create_task(self.heartbeat_loop(), name="heartbeats")
        closer = asyncio.create_task(self._close_on(stop, ws), name="closer")
        try:
            async for message in ws:
                self.handle_message(message)
        finally:
            self.socket = None
            self.close_code = ws.close_code
            self._outbox = []  # replies to the old connection's requests go nowhere
            if self._heartbeats is not None:
                self._heartbeats.cancel()
            closer.cancel()
            self.receiver.disconnected()
        if not stop.is_set():
            logger.warning("platform closed the connection (code %s)", ws.close_code)

    async def _close_on(self, stop: asyncio.Event, ws: ClientConnection) -> None:
        await stop.wait()
        await ws.close()

    def handle_message(self, message: str | bytes) -> None:
        """Hand one incoming message to the receiver, a binary one frame by frame."""
        if isinstance(message, str):
            self.receiver.handle_control(message)
            return
        try:
            frames = unpack_frames(message)
        except ValueError as exc:
            logger.warning("ignoring undecodable binary message: %s", exc)
            return
        for frame in frames:
            self.receiver.handle_frame(frame)

    async def send(self, message: str | bytes) -> None:
        """Send on the open websocket; dropped while disconnected (a reconnect re-syncs)."""
        socket = self.socket
        if socket is None:
            return
        try:
            await socket.send(message)
        except ConnectionClosed:
            pass

    async def send_frames(self, frames: list[bytes], socket: Socket | None = None) -> None:
        """Queue reply frames; the first sender of an event-loop turn sends all of the turn's
        frames as one message (a finished batch wakes all its requests in the same turn).

        With ``socket``, the frames are dropped unless it is still the open one: a generation
        stream answers only on the connection it came from.
        """
        if socket is not None and socket is not self.socket:
            return
        self._outbox.extend(frames)
        if len(self._outbox) > len(frames):
            return  # an earlier reply of this turn is the flusher
        try:
            await asyncio.sleep(0)  # let the rest of this turn's replies join
        finally:
            # Taken even when cancelled, so the next reply finds an empty outbox and flushes.
            frames, self._outbox = self._outbox, []
        if frames:
            await self.send(pack_frames(frames))

    def stream_sender(self) -> SendFrames:
        """Sends a stream's frames on the open websocket, and never on a later one. One object
        per websocket, so an engine step's frames for it go out together."""
        socket = self.socket
        if self._stream_sender is None or self._stream_sender[0] is not socket:
            self._stream_sender = (socket, partial(self.send_frames, socket=socket))
        return self._stream_sender[1]

    def set_heartbeat_interval(self, seconds: float) -> None:
        """Send heartbeats every ``seconds`` from now on."""
        if seconds == self.heartbeat_s:
            return
        self.heartbeat_s = seconds
        if self._heartbeats is not None and not self._heartbeats.done():
            # Restart rather than finish a sleep of the old (maybe much longer) interval.
            self._heartbeats.cancel()
            self._heartbeats = asyncio.create_task(self.heartbeat_loop(), name="heartbeats")

    async def heartbeat_loop(self) -> None:
        assert self._heartbeat is not None
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.send(self._heartbeat().model_dump_json())
