"""The websocket consumer that serving agents connect to.

It authenticates the node, records its session, sends it the versions it must serve, tracks
which are ready, and hands reply frames to the process's ``AgentPool``. Requests from other
gateway processes arrive through the channel layer (``agent.forward``) and their replies go
back the same way.

An agent is not trusted: it is routed only the versions this connection is assigned now, and
a state of a version it was never assigned (another tenant's, or a forgery) closes the socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from pydantic import ValidationError

from fleet import assignments, nodes
from platform_site.tokens import bearer
from serving_agent.protocol import (
    CLOSE_BAD_MESSAGE,
    CLOSE_CLAIM_REFUSED,
    CLOSE_UNAUTHORIZED,
    Assign,
    Attach,
    Detach,
    FrameError,
    GenerateRequest,
    Heartbeat,
    Hello,
    InferRequest,
    Links,
    TokenBatch,
    TokenChunk,
    VersionSpec,
    VersionStatus,
    agent_message,
    decode_frame,
    encode_frame,
    error_frame,
    pack_frames,
    unpack_frames,
)
from tenants.ratelimit import REDIS_ERRORS

from .db import db_call
from .dispatch import AgentLink
from .state import carry, get_state

log = logging.getLogger(__name__)


WRITE_TRIES = 30  # a state write that keeps failing is retried this often, every WRITE_RETRY_S
WRITE_RETRY_S = 1.0
# The websocket close code an ASGI server reports for a socket it closes at its own shutdown
# ("service restart").
SERVER_RESTART = 1012


class SessionWrites:
    """The database writes of one agent connection (heartbeats, version states, its session's
    end), made in order by a task of their own. The socket's receive loop never waits for the
    database: replies keep flowing while a write waits for a lock. Heartbeats coalesce (only
    the latest unwritten one is written), so a stalled database grows nothing but the
    handful of state changes."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._writes: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._heartbeat: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._tries = 0

    def put(self, fn: Callable[..., Any], *args: Any) -> None:
        self._writes.append((fn, args))
        self._start()

    def heartbeat(self, fn: Callable[..., Any], *args: Any) -> None:
        self._heartbeat = (fn, args)
        self._start()

    async def flushed(self) -> None:
        """Return when every write queued so far is made (or failed)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._writes or self._heartbeat is not None:
            if self._writes:
                fn, args = self._writes[0]
                if await self._write(fn, args) or self._tries >= WRITE_TRIES:
                    self._writes.popleft()
                    self._tries = 0
                else:  # a state change must not be lost to a blip: try it again shortly
                    self._tries += 1
                    await asyncio.sleep(WRITE_RETRY_S)
            else:
                assert self._heartbeat is not None
                (fn, args), self._heartbeat = self._heartbeat, None
                await self._write(fn, args)  # a failed one is superseded by the next

    async def _write(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> bool:
        try:
            await db_call(fn)(*args)
        except Exception:
            log.warning("agent %s: could not record %s", self.label, fn.__name__, exc_info=True)
            return False
        return True


class AgentConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        headers = dict(self.scope["headers"])
        token = bearer(headers.get(b"authorization", b"").decode("latin-1"))
        self.node = await db_call(nodes.authenticate_node)(token)
        self.link: AgentLink | None = None
        self.session_id: int | None = None
        self.sent_assignment: list[VersionSpec] | None = None
        self.assigned: set[int] = set()  # the versions of the latest assignment sent
        self.ever_assigned: set[int] = set()  # every version assigned on this connection
        self.refused = False
        self.remote_replies: dict[int, str] = {}  # request id -> reply channel
        self.attached: int | None = None  # a data link: the session whose versions it serves
        self.sent_links: Links | None = None
        self.writes = SessionWrites(str(self.node))
        if self.node is None:
            log.warning("agent connection refused: unknown or disabled node token")
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        self.state = get_state()
        await self.accept()

    async def dispatch(self, message: dict[str, Any]) -> None:
        # Channels' own dispatch closes stale database connections through a thread hop before
        # every message (measured: ~30% of the gateway's CPU under load). Reply frames touch no
        # database, and every query here goes through database_sync_to_async, which does it.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.node is None or self.refused:
            return
        if bytes_data is not None:
            await self._reply_message(bytes_data)
            return
        try:
            message = agent_message.validate_json(text_data or "")
        except ValidationError as exc:
            log.warning("node %s sent an invalid message: %s", self.node, exc)
            await self.close(code=CLOSE_BAD_MESSAGE)
            return
        if isinstance(message, Hello) and self.attached is None:
            await self._hello(message)
        elif isinstance(message, Attach) and self.session_id is None:
            await self._attach(message)
        elif isinstance(message, Detach) and self.attached is not None and self.link is not None:
            self.state.pool.detach(self.link)
            log.info("agent %s: data link for session %s retired", self.node, self.attached)
        elif self.link is None or self.session_id is None:
            # Anything before hello, and anything but replies and attach on a data link (which
            # claims nothing of its own), is a protocol error.
            await self.close(code=CLOSE_BAD_MESSAGE)
        elif isinstance(message, VersionStatus):
            await self._status(message)
        elif isinstance(message, Heartbeat):
            # An agent's claims count only for versions assigned to it: its compute is billed.
            message.versions = [v for v in message.versions if v.version_id in self.ever_assigned]
            self.writes.heartbeat(
                nodes.record_heartbeat,
                self.session_id,
                self.node.pk,
                message.model_dump(exclude={"type"}),
            )
        else:  # an attach on a main connection
            await self.close(code=CLOSE_BAD_MESSAGE)

    async def _hello(self, hello: Hello) -> None:
        assert self.node is not None  # receive() answers nothing for a refused token
        try:
            session = await db_call(nodes.open_session)(self.node, self.channel_name, hello)
        except nodes.ClaimRefused as exc:
            await self._refuse(str(exc))
            return
        self.session_id = session.pk
        if self.link is None:
            self.link = AgentLink(self.channel_name, self._send_message)
            self.state.pool.add(self.link)
            self.state.agent_consumers.add(self)
        self.link.groups = hello.groups
        self.state.pool.set_spot(self.link, await db_call(nodes.session_spot)(session.pk))
        log.info(
            "agent %s connected from %s (%s)", self.node, hello.host, ", ".join(hello.providers)
        )
        await self.push_assignment(force=True)
        await self.push_links()

    async def _attach(self, attach: Attach) -> None:
        """A data link: this agent's main connection is held by another gateway process (or
        its session was just reopened there). It serves what that session has ready."""
        assert self.node is not None
        ready = await db_call(nodes.attached_ready)(self.node, attach.session)
        if ready is None:
            await self._refuse(f"session {attach.session}, not a live session of its node")
            return
        self.attached = attach.session
        if self.link is None:
            self.link = AgentLink(self.channel_name, self._send_message, node_id=self.node.pk)
            self.state.pool.add(self.link)
        elif not ready and self.link.session != attach.session:
            # A new session of the same agent, nothing reported ready yet: keep serving.
            carry(self.link, time.monotonic())
        self.link.session = attach.session
        self.link.groups = attach.groups
        self.state.pool.set_spot(self.link, await db_call(nodes.session_spot)(attach.session))
        if ready or not self.link.carried:
            self.link.carried, self.link.carried_until = set(), 0.0
            self.state.pool.set_ready_versions(self.link, set(ready))
        log.info("agent %s: data link for session %s", self.node, attach.session)

    async def push_links(self) -> None:
        """Tell the agent the other gateway processes' link addresses and its session, when
        they changed (main connections only; one gateway process sends none)."""
        if self.session_id is None or self.refused:
            return
        links = Links(session=self.session_id, urls=self.state.other_gateways)
        if links == self.sent_links or (self.sent_links is None and not links.urls):
            return
        self.sent_links = links
        await self.send(text_data=links.model_dump_json())

    async def _status(self, status: VersionStatus) -> None:
        assert self.link is not None
        version_id = status.version_id
        if version_id not in self.ever_assigned:
            await self._refuse(f"a state of version {version_id}, never assigned to it")
            return
        # A version assigned earlier but not now (the assignment changed while it loaded) is
        # recorded, but never routed.
        ready = status.state == "ready" and version_id in self.assigned
        self.state.pool.set_ready(self.link, version_id, ready)
        log.info(
            "node %s: version %s %s %s",
            self.node,
            status.version_id,
            status.state,
            status.detail or status.provider,
        )
        ready_now = sorted(self.link.ready)
        self.writes.put(nodes.record_version_state, self.session_id, status, ready_now)

    async def push_assignment(self, force: bool = False) -> None:
        """Send the versions this node must serve, when they changed since the last send."""
        if self.node is None or self.session_id is None:
            return
        node = await db_call(nodes.reload_node)(self.node.pk)
        if node is None or not node.enabled:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        specs = await db_call(assignments.assignment_for)(node, self.session_id)
        if self.link is not None:  # its pool may have been marked spot (or not) since
            spot = await db_call(nodes.session_spot)(self.session_id)
            self.state.pool.set_spot(self.link, spot)
        if force or specs != self.sent_assignment:
            self.sent_assignment = specs
            heartbeat = settings.SWITCHYARD_AGENT_HEARTBEAT_S
            await self.send(
                text_data=Assign(versions=specs, heartbeat_s=heartbeat).model_dump_json()
            )
            self.assigned = {s.version_id for s in specs}
            self.ever_assigned |= self.assigned
            revoked = self.link.ready - self.assigned if self.link is not None else set()
            if self.link is not None and revoked:
                for vid in revoked:
                    self.state.pool.set_ready(self.link, vid, False)
                # Other gateway processes route by the session row: take them off it too.
                self.writes.put(nodes.record_ready, self.session_id, sorted(self.link.ready))

    async def _refuse(self, claim: str) -> None:
        """The agent claimed what was not assigned to it: it gets no more requests, and the
        socket is closed with CLOSE_CLAIM_REFUSED."""
        log.warning("agent of node %s refused: it claimed %s", self.node, claim)
        self.refused = True
        if self.link is not None:
            self.state.pool.remove(self.link, "the serving agent's connection was refused")
        if self.session_id is not None:
            # Now, not when the socket's disconnect arrives: other processes route by it.
            self.writes.put(nodes.close_session, self.session_id)
        # The record first, then the close: whoever sees the socket closed (the agent, a test,
        # an operator) finds the session closed too. It is already out of this process's pool.
        await self.writes.flushed()
        await self.close(code=CLOSE_CLAIM_REFUSED)

    async def _send_message(self, message: bytes) -> None:
        await self.base_send({"type": "websocket.send", "bytes": message})

    async def _reply_message(self, message: bytes) -> None:
        try:
            frames = unpack_frames(message)
        except FrameError as exc:
            log.warning("node %s sent an undecodable message: %s", self.node, exc)
            return
        for frame in frames:
            await self._reply_frame(frame)

    async def _reply_frame(self, data: bytes) -> None:
        if self.link is None:
            return
        unmatched = self.state.pool.deliver(self.link, data)
        if unmatched is None:
            return
        # Not a local request: it may answer one forwarded from another gateway process. A
        # stream's token chunks keep the route; its last frame (done or error) ends it.
        if isinstance(unmatched, TokenBatch):
            await self._forward_chunks(unmatched)
            return
        if isinstance(unmatched, TokenChunk):
            reply_channel = self.remote_replies.get(unmatched.id)
        else:
            reply_channel = self.remote_replies.pop(unmatched.id, None)
        if reply_channel is not None:
            await self._send_remote(reply_channel, data)

    async def _forward_chunks(self, batch: TokenBatch) -> None:
        """The chunks of a batch that streams of other gateway processes read: one batch per
        process, only the chunks of its own streams."""
        by_channel: dict[str, list[TokenChunk]] = {}
        for chunk in batch.chunks:
            channel = self.remote_replies.get(chunk.id)
            if channel is not None:
                by_channel.setdefault(channel, []).append(chunk)
        for channel, chunks in by_channel.items():
            await self._send_remote(channel, encode_frame(TokenBatch(chunks)))

    async def _send_remote(self, channel: str, frame: bytes) -> None:
        """A reply to another gateway process. With Redis down it cannot get there: that
        process's request times out, and this socket (which other requests need) stays up."""
        try:
            await self.channel_layer.send(channel, {"type": "infer.reply", "frame": frame})
        except REDIS_ERRORS as exc:
            log.warning("could not pass a reply to another gateway process: %r", exc)

    async def agent_forward(self, event: dict[str, Any]) -> None:
        """A request from another gateway process for the agent on this socket."""
        try:
            header, _ = decode_frame(event["frame"])
        except FrameError:
            return
        if isinstance(header, InferRequest | GenerateRequest):
            # A cancel gets no reply of its own (the request it names does), so it must not
            # open a route that nothing would ever close.
            self.remote_replies[header.id] = event["reply"]
        await self._send_message(pack_frames([event["frame"]]))

    async def disconnect(self, code: int) -> None:
        # 1012 (service restart) is what the ASGI server reports when it closes the socket
        # itself at shutdown.
        await self._forget(restarting=code == SERVER_RESTART)
        log.info("agent %s disconnected (code %s)", self.node, code)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # An error that ends the consumer skips ``disconnect``: the link must still leave
            # the pool at once, or requests keep being sent to a socket nobody reads.
            link = getattr(self, "link", None)
            if link is not None:
                self.state.pool.remove(link, "the serving agent's connection failed")
                self.state.agent_consumers.discard(self)

    async def _forget(self, restarting: bool = False) -> None:
        """This connection is gone: out of the pool, its forwarded requests failed, its
        session closed (once, however often it is called)."""
        link, self.link = self.link, None
        if link is not None:
            if restarting:
                reason = "this gateway process is shutting down; retry the request"
            else:
                reason = "the serving agent disconnected during the request"
            self.state.pool.remove(link, reason, restarting=restarting)
            self.state.agent_consumers.discard(self)
            for request_id, channel in self.remote_replies.items():
                # A shutdown leaves the agent serving: the other process may try elsewhere.
                if restarting:
                    frame = error_frame(request_id, "not_loaded", reason)
                else:  # the forwarding process answers 502, and counts no model failure
                    frame = error_frame(request_id, "gone", reason)
                await self._send_remote(channel, frame)
            self.remote_replies.clear()
        session_id, self.session_id = self.session_id, None
        if session_id is not None:
            self.writes.put(nodes.close_session, session_id)
        await self.writes.flushed()
