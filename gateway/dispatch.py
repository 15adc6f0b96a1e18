"""Handing inference requests to serving agents and matching their replies.

An ``AgentPool`` lives in each gateway process (one per event loop). It knows the agent
connections this process holds (``AgentLink``: an agent's main connection, or a data link the
agent opened to this process) and which versions each has ready, and picks the one with the
fewest outstanding requests. A request goes straight to that socket, in process; only when no
agent link here serves the version (a process that just started, before the agents' data links
reach it) does it travel through the channel layer (Redis) to the process that holds one.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from serving_agent.protocol import (
    BATCH,
    INTERACTIVE,
    CancelGenerate,
    FrameError,
    FrameTensor,
    GenerateDone,
    GenerateRequest,
    InferError,
    InferRequest,
    InferResult,
    Member,
    TokenBatch,
    TokenChunk,
    decode_frame,
    encode_frame,
    pack_frames,
    tensor_of,
)

from .breakers import Breaker

log = logging.getLogger(__name__)

AgentReply = tuple[InferResult | InferError, list[np.ndarray]]
# What an agent may send: answers to requests and the frames of streams.
AgentFrame = InferResult | InferError | TokenChunk | TokenBatch | GenerateDone
# Frames of one generation buffered for its client; past this the client is reading too slowly
# and the stream is ended rather than buffered without bound.
STREAM_BUFFER = 256


# What an agent's error code means to a client: its input was refused, its tenant holds its
# share of a shared version (retry later), the agent cannot take it now (retry), or its
# deadline passed before compute. "cancelled" answers a client that is gone (nginx's 499).
# Anything else is the agent's own failure.
AGENT_ERROR_STATUS = {
    "bad_input": 400,
    "over_share": 429,
    "overloaded": 503,
    "not_loaded": 503,
    "expired": 504,
    "cancelled": 499,
    "gone": 502,
}
# Statuses that tell the client to come back: they carry Retry-After.
RETRY_STATUSES = (429, 503)
# An agent's refusals of work it never started: another replica may take the request.
NOT_STARTED = ("overloaded", "not_loaded")


def status_of(error: InferError) -> int:
    """The HTTP status that answers an agent's error (500 for an internal one)."""
    return AGENT_ERROR_STATUS.get(error.code, 500)


class DispatchError(Exception):
    """The request could not be served; ``status`` is the HTTP status to answer with."""

    def __init__(
        self,
        status: int,
        message: str,
        retry_after: int | None = None,
        *,
        transport: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        # A failure of the way to the agent (a forwarded request whose answer never came back
        # through the channel layer), not of the model: never counted against the version.
        self.transport = transport


class NotReady(DispatchError):
    """No replica of the version is ready yet (an agent still loading it, or a cold start past
    its hold): 503 with Retry-After, counted as "not ready", not as the version failing."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(503, message, retry_after)


class NotSent(DispatchError):
    """The request never reached an agent (its socket failed under the send): safe to retry."""


class SlowClient(DispatchError):
    """The client did not read its stream's frames fast enough; the stream was ended."""


# What a stream's reader takes: the agent's frames, or the failure that ended the stream.
StreamItem = TokenChunk | GenerateDone | InferError | DispatchError


@dataclass(eq=False)
class StreamInbox:
    """One generation in flight: the agent's frames wait here until the client takes them.

    The reader takes every chunk of text waiting as one (``next``), so a client that is behind
    gets one message for what piled up rather than one per token; a reader that keeps up gets
    each chunk as soon as it arrives. This costs per frame a deque append and, when the reader
    waits, one future: the platform's per-token cost is what limited streaming throughput.
    """

    id: int
    send: Callable[[bytes], Awaitable[None]]  # to the agent holding the stream
    items: deque[StreamItem] = field(default_factory=deque)
    ended: bool = False
    _waiter: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    def push(self, item: StreamItem) -> bool:
        """Queue a frame (or a failure) for the reader; False when the buffer is full."""
        if len(self.items) >= STREAM_BUFFER:
            return False
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    def fail(self, error: DispatchError) -> None:
        """End the stream with ``error``, after what the reader has not taken yet; if the
        buffer is full the reader is far behind, and only the error matters any more."""
        if not self.push(error):
            self.items.clear()
            self.push(error)

    async def next(self, timeout: float) -> TokenChunk | GenerateDone:
        """The next frame, every chunk of text waiting joined into one; raises
        ``DispatchError`` when the stream failed or went silent for ``timeout`` seconds."""
        if not self.items:
            await self._wait(timeout)
        item = self.items.popleft()
        if isinstance(item, TokenChunk) and self.items and isinstance(self.items[0], TokenChunk):
            texts, tokens = [item.text], item.tokens
            while self.items and isinstance(chunk := self.items[0], TokenChunk):
                self.items.popleft()
                texts.append(chunk.text)
                tokens += chunk.tokens
            item = TokenChunk(self.id, "".join(texts), tokens)
        if isinstance(item, DispatchError):
            raise item
        if isinstance(item, InferError):
            status = status_of(item)
            raise DispatchError(status, item.message, 1 if status in RETRY_STATUSES else None)
        return item

    async def _wait(self, timeout: float) -> None:
        """Until a frame arrives. A bare timer rather than ``asyncio.timeout``, which cost a
        few microseconds more on every wait, that is on every token of a stream that keeps up."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        except TimeoutError:
            raise DispatchError(504, f"the serving agent sent nothing for {timeout:g} s") from None
        finally:
            timer.cancel()
            self._waiter = None

    async def cancel(self) -> None:
        """Ask the agent to stop decoding this stream at its next step."""
        if self.ended:
            return
        self.ended = True
        try:
            await self.send(encode_frame(CancelGenerate(id=self.id)))
        except Exception as exc:  # the agent may be gone already; nothing left to stop
            log.info("could not cancel stream %d: %r", self.id, exc)


@dataclass(eq=False, slots=True)
class Staged:
    """A request queued for its turn's message: on a link whose agent takes groups, it may
    travel in one frame with other requests of the same caller for the same version."""

    request: InferRequest
    arrays: list[np.ndarray]
    max_rows: int  # the version's batch size: a group holds no more rows

    def group_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can share a frame: same version, caller, class, asked
        outputs, and inputs that concatenate (names, datatypes, non-batch dims)."""
        r = self.request
        inputs = tuple((t.name, t.datatype, *t.shape[1:]) for t in r.inputs)
        outputs = None if r.outputs is None else tuple(r.outputs)
        return (r.version_id, r.tenant, r.key, r.priority, outputs, inputs)


@dataclass(eq=False)
class Group:
    """A grouped frame in flight: its members (each also in ``AgentLink.pending`` under its
    own id) and how many still wait for it."""

    id: int
    members: list[Member]
    waiting: int


@dataclass(eq=False)
class AgentLink:
    """One agent websocket held by this process: its main connection, or a data link (then
    ``session`` is the main connection's session, whose ready versions it serves)."""

    name: str
    send_message: Callable[[bytes], Awaitable[None]]
    ready: set[int] = field(default_factory=set)
    session: int | None = None
    node_id: int = 0
    # The agent runs in a spot (preemptible) pool: batch-class requests prefer it, every other
    # request avoids it while a non-spot link serves the version. Set (``AgentPool.set_spot``)
    # when the agent says hello or attaches, from its deployment's pool, and followed when its
    # assignment changes: dispatch reads no database.
    spot: bool = False
    # A data link whose agent's main connection is moving (its session closed, or a new one
    # not yet ready) keeps serving what it served until the new session reports a ready
    # version or ``carried_until`` (time.monotonic) passes; see GatewayState._follow_sessions.
    carried: set[int] = field(default_factory=set)
    carried_until: float = 0.0
    # The agent retires this data link (``Detach``): nothing new is sent on it, its requests
    # in flight are still answered on it until the agent closes it.
    detached: bool = False
    pending: dict[int, asyncio.Future[AgentReply]] = field(default_factory=dict)
    streams: dict[int, StreamInbox] = field(default_factory=dict)
    outbox: list[bytes | Staged] = field(default_factory=list)
    # The agent takes grouped infer frames (``Hello.groups``): a turn's requests of one caller
    # for one version travel as one frame, decoded, queued, run and answered once by the
    # agent. ``ids`` (the pool's) names the groups; ``in_flight`` holds those sent and not yet
    # answered, and ``member_of`` each waiting member's group.
    groups: bool = False
    ids: Iterator[int] | None = None
    in_flight: dict[int, Group] = field(default_factory=dict)
    member_of: dict[int, Group] = field(default_factory=dict)
    # Opened by requests that could not be sent, or that this agent never answered.
    breaker: Breaker = field(default_factory=Breaker)
    # Set by AgentPool.remove: how requests still on the link were failed (see ``ended_as``).
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    ended_with: DispatchError | None = None

    async def send_frame(self, frame: bytes | Staged) -> None:
        """Queue a frame (or a request to group); the first sender of an event-loop turn
        sends the turn's frames as one websocket message (see
        ``serving_agent.protocol.pack_frames``)."""
        self.outbox.append(frame)
        if len(self.outbox) > 1:
            return  # an earlier request of this turn is already the flusher
        try:
            await asyncio.sleep(0)  # let the rest of this turn's requests queue their frames
        except asyncio.CancelledError:
            # The flusher's own client left in this very turn. The turn's other frames must
            # still go, and the outbox must be empty for the next turn's flusher: left full,
            # every later sender would wait for a flush that never comes and the link would
            # answer nothing again.
            items, self.outbox = self.outbox, []
            in_background(self._flush(items))
            raise
        items, self.outbox = self.outbox, []
        await self.send_message(pack_frames(self._frames_of(items)))

    async def _flush(self, items: list[bytes | Staged]) -> None:
        """Send a turn's frames for a flusher that was cancelled; a failure is the socket's
        end, which ``AgentPool.remove`` reports to the requests waiting on it."""
        try:
            await self.send_message(pack_frames(self._frames_of(items)))
        except Exception as exc:  # noqa: BLE001 - nobody awaits this send
            log.info("could not send a turn's frames on %s: %r", self.name, exc)

    def _frames_of(self, items: list[bytes | Staged]) -> list[bytes]:
        """A turn's frames: staged requests grouped by ``Staged.group_key`` (in order, up to
        the version's batch size each), every other frame as it came."""
        slots: list[bytes | list[Staged]] = []
        open_groups: dict[tuple[Any, ...], tuple[list[Staged], list[int]]] = {}
        for item in items:
            if isinstance(item, bytes):
                slots.append(item)
                continue
            if item.request.id not in self.pending:
                continue  # its caller stopped waiting before the turn ended: nothing to send
            key = item.group_key()
            rows = item.arrays[0].shape[0] if item.arrays and item.arrays[0].ndim else 1
            found = open_groups.get(key)
            if found is not None and found[1][0] + rows <= item.max_rows:
                found[0].append(item)
                found[1][0] += rows
                continue
            members = [item]
            open_groups[key] = (members, [rows])
            slots.append(members)
        return [slot if isinstance(slot, bytes) else self._encode(slot) for slot in slots]

    def _encode(self, staged: list[Staged]) -> bytes:
        """One request's frame, or one frame for a group (its inputs concatenated)."""
        if len(staged) == 1:
            return encode_frame(staged[0].request, staged[0].arrays)
        assert self.ids is not None  # set by AgentPool.add
        first = staged[0].request
        members = [Member(s.request.id, s.arrays[0].shape[0], s.request.trace) for s in staged]
        arrays = [np.concatenate([s.arrays[i] for s in staged]) for i in range(len(first.inputs))]
        group = InferRequest(
            id=next(self.ids),
            version_id=first.version_id,
            inputs=[
                FrameTensor(t.name, t.datatype, list(a.shape))
                for t, a in zip(first.inputs, arrays, strict=True)
            ],
            outputs=first.outputs,
            tenant=first.tenant,
            key=first.key,
            priority=first.priority,
            # The longest of its members': each member's own deadline is still kept here.
            budget_ms=max(s.request.budget_ms or 0.0 for s in staged),
            members=members,
        )
        record = Group(group.id, members, len(members))
        self.in_flight[group.id] = record
        for member in members:
            self.member_of[member.id] = record
        return encode_frame(group, arrays)

    def leave_group(self, request_id: int) -> int | None:
        """A request stops waiting (answered, or given up): the id an agent would know it by
        to cancel it: its own when it travelled alone, its group's when it was the group's
        last member waiting, else None (the others still want the group's run)."""
        group = self.member_of.pop(request_id, None)
        if group is None:
            return request_id
        group.waiting -= 1
        if group.waiting:
            return None
        self.in_flight.pop(group.id, None)
        return group.id

    def answer_group(
        self, group: Group, header: InferResult | InferError, arrays: list[np.ndarray]
    ) -> None:
        """Answer a group's waiting members from its one reply: an error answers each alike,
        a result gives each its own rows."""
        for member in group.members:
            self.member_of.pop(member.id, None)
        futures = [(m, self.pending.pop(m.id, None)) for m in group.members]
        if isinstance(header, InferError):
            for _, fut in futures:
                if fut is not None:
                    _answer(fut, header, [])
            return
        rows = sum(m.rows for m in group.members)
        if any(a.ndim == 0 or a.shape[0] != rows for a in arrays):
            broken = DispatchError(
                502, f"the serving agent answered a group of {rows} rows with other rows"
            )
            for _, fut in futures:
                if fut is not None and not fut.done():
                    fut.set_exception(broken)
            return
        start = 0
        for member, fut in futures:
            end = start + member.rows
            if fut is not None:
                _answer(fut, header, [a[start:end] for a in arrays])
            start = end


# How long a failed send waits for its socket's end to be reported (see ``ended_as``).
SEND_FAILURE_GRACE_S = 0.2


async def ended_as(link: AgentLink, failure: NotSent) -> DispatchError:
    """What a request whose send failed on ``link`` answers. The send fails the moment the
    socket closes, a moment before the server reports why: a shutdown of this process (then
    a retryable 503, the agent being fine) or the agent gone (502). Wait that moment."""
    try:
        await asyncio.wait_for(link.ended.wait(), SEND_FAILURE_GRACE_S)
    except TimeoutError:
        return failure
    return link.ended_with or failure


class Expired(Exception):
    """A request's deadline passed before its agent answered (``Deadlines``)."""


class Deadlines:
    """The deadlines of the requests waiting for agents, kept by one timer for all of them.

    ``asyncio.timeout`` per request made a timer, a heap entry and a cancel on every request,
    ~12 µs of the gateway's CPU of a ~200 µs request at 64 connections (bench/README.md, "The
    gateway's own cost"). Here a request's deadline is one entry in a heap; the one timer is
    moved only when an entry comes before its time, which is rare, since most requests have
    the same budget and so later deadlines than those already waiting. An answered request
    leaves its entry empty (``entry[2] = None``), and empty entries at the top are dropped as
    entries are added, so the heap holds about the requests in flight.
    """

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []  # [when, sequence, future or None]
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def add(self, fut: asyncio.Future[Any], timeout: float) -> list[Any]:
        """Fail ``fut`` with ``Expired`` in ``timeout`` seconds unless it is done by then;
        the caller empties the returned entry once it stops waiting."""
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        loop = fut.get_loop()
        when = loop.time() + timeout
        entry: list[Any] = [when, next(self._order), fut]
        heapq.heappush(heap, entry)
        if when < self._timer_at:
            self._arm(loop, when)
        return entry

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(when, self._expire, loop), when

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._timer_at = None, math.inf
        heap, now = self._heap, loop.time()
        while heap and (heap[0][2] is None or heap[0][0] <= now):
            fut = heapq.heappop(heap)[2]
            if fut is not None and not fut.done():
                fut.set_exception(Expired())
        if heap:
            self._arm(loop, heap[0][0])


class AgentPool:
    def __init__(self, breaker_failures: int = 5, breaker_cooldown_s: float = 5.0) -> None:
        self.deadlines = Deadlines()
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        # A timeout counts against an agent only when the request had (about) the server's
        # whole budget: a client's own short deadline says nothing about the agent, and must
        # not let one caller open the breaker on everyone's agent.
        self.full_budget_s = 10.0
        self._links: list[AgentLink] = []
        self._by_version: dict[int, list[AgentLink]] = {}
        # Versions served here by spot and non-spot links both: only their requests filter
        # the links by kind (``prefer_spot``); for every other version a set lookup is all.
        self._mixed: set[int] = set()
        # Ids are unique across processes, so an agent reached through the channel layer can
        # be handed requests from several gateways without renumbering them.
        self._ids = itertools.count((random.getrandbits(20) << 32) + 1)
        # Filled by the gateway's refresh loop: version id -> channel names in other processes.
        self.remote: dict[int, list[str]] = {}
        # Of those, the channels of agents in a spot pool (see ``prefer_spot``).
        self.remote_spot: set[str] = set()
        self.remote_sender: Callable[[str, bytes], Awaitable[None]] | None = None
        self._remote_pending: dict[int, asyncio.Future[AgentReply]] = {}
        self._remote_channel: dict[int, str] = {}  # where each forwarded request went
        self._remote_streams: dict[int, StreamInbox] = {}
        # Requests sent on a link held here, forwarded through the channel layer, and sent
        # again to another replica after the first could not take them.
        self.dispatched = {"local": 0, "forwarded": 0, "retried": 0}
        self._turn = 0

    # Links -------------------------------------------------------------------------------------
    def add(self, link: AgentLink) -> None:
        link.breaker = Breaker(self.breaker_failures, self.breaker_cooldown_s)
        link.ids = self._ids
        self._links.append(link)

    def set_ready(self, link: AgentLink, version_id: int, ready: bool) -> None:
        (link.ready.add if ready else link.ready.discard)(version_id)
        self._reindex()

    def set_ready_versions(self, link: AgentLink, ready: set[int]) -> None:
        """Replace what a link serves (a data link follows its session's ready versions)."""
        if ready != link.ready:
            link.ready = set(ready)
            self._reindex()

    def set_spot(self, link: AgentLink, spot: bool) -> None:
        """Mark a link as an agent in a spot pool (or not), from its session's pool."""
        if spot != link.spot:
            link.spot = spot
            self._reindex()

    def data_links(self) -> list[AgentLink]:
        """The data links that may be sent work (not retired by their agent)."""
        return [link for link in self._links if link.session is not None and not link.detached]

    def detach(self, link: AgentLink) -> None:
        """Send nothing new on a link its agent retires; its requests in flight stay."""
        link.detached = True
        link.carried, link.carried_until = set(), 0.0
        self.set_ready_versions(link, set())

    def remove(self, link: AgentLink, reason: str, *, restarting: bool = False) -> None:
        """Forget a link and fail its outstanding requests at once: 502 when the agent went
        away (with a retry hint when it was a spot replica, pre-empted), 503 with a retry hint
        when this server is shutting down (the agent is fine and a retry reaches it through
        another process)."""
        if link in self._links:
            self._links.remove(link)
            self._reindex()
        status, retry_after = (503, 1) if restarting else (502, None)
        if link.spot and not restarting:
            # A spot replica is taken away by design (pre-emption): say the request may be
            # sent again, and the retry lands on the version's other replicas.
            retry_after = 1
        link.ended_with = DispatchError(status, reason, retry_after)
        link.ended.set()
        for fut in link.pending.values():
            if not fut.done():
                fut.set_exception(DispatchError(status, reason, retry_after))
        link.pending.clear()
        link.in_flight.clear()
        link.member_of.clear()
        for stream in link.streams.values():
            stream.ended = True  # nothing left to cancel
            stream.fail(DispatchError(status, reason, retry_after))
        link.streams.clear()

    def _reindex(self) -> None:
        index: dict[int, list[AgentLink]] = {}
        for link in self._links:
            for vid in link.ready:
                index.setdefault(vid, []).append(link)
        self._by_version = index
        self._mixed = {
            vid for vid, links in index.items() if len({link.spot for link in links}) > 1
        }

    def set_remote(self, remote: dict[int, list[str]]) -> None:
        """The agents other processes hold, per version (the refresh loop's). A forwarded
        request whose agent is no longer listed there (the process holding its connection
        died, so the agent's session closed or was superseded) fails now, 502 with a retry
        hint, instead of at its deadline: no answer can come back."""
        self.remote = remote
        listed = {channel for channels in remote.values() for channel in channels}
        for request_id, channel in list(self._remote_channel.items()):
            fut = self._remote_pending.get(request_id)
            if channel not in listed and fut is not None and not fut.done():
                reason = "the gateway process holding the serving agent's connection went away"
                fut.set_exception(DispatchError(502, reason, 1, transport=True))

    def is_ready(self, version_id: int) -> bool:
        return bool(self._by_version.get(version_id) or self.remote.get(version_id))

    def any_ready(self) -> bool:
        """Whether some version can be served (by a link here or, through Redis, elsewhere)."""
        return bool(self._by_version or self.remote)

    def local_channel_names(self) -> set[str]:
        return {link.name for link in self._links}

    def _pick(self, links: list[AgentLink], load: Callable[[AgentLink], int]) -> AgentLink:
        """The link with the least ``load``; ties taken in turn, so that agents share even
        traffic that never queues."""
        if len(links) == 1:
            return links[0]
        self._turn += 1
        start = self._turn % len(links)
        return min(links[start:] + links[:start], key=load)

    # Requests ----------------------------------------------------------------------------------
    async def infer(
        self,
        version_id: int,
        names: list[str],
        arrays: list[np.ndarray],
        outputs: list[str] | None,
        timeout: float,
        trace: str = "",
        *,
        tenant: int = 0,
        key: int = 0,
        priority: int = INTERACTIVE,
        max_rows: int = 0,
    ) -> AgentReply:
        """Send one request to an agent serving the version and wait for its reply.

        ``timeout`` (seconds) travels as the request's budget: the agent drops it unrun once
        that much time has passed since it arrived there. A caller that stops waiting (the
        timeout, or its task cancelled when the client went away) sends a cancel frame, so a
        queued request is never computed for nobody. ``max_rows`` > 0 (the version's batch
        size) lets it share a frame with requests of the same caller sent in the same turn.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        request = InferRequest(
            id=0,
            version_id=version_id,
            inputs=[tensor_of(n, a) for n, a in zip(names, arrays, strict=True)],
            outputs=outputs,
            trace=trace,
            tenant=tenant,
            key=key,
            priority=priority,
            budget_ms=0.0,
        )
        tried: list[AgentLink] = []
        while True:
            link = self._local_link(version_id, tried, priority)
            if link is None:
                break
            try:
                left = deadline - loop.time() if tried else timeout
                reply = await self._infer_on(link, request, arrays, left, max_rows)
            except NotSent as exc:
                if tried or not self._local_link(version_id, [link]):
                    raise await ended_as(link, exc) from None
                tried.append(link)  # the request never left: another replica may take it
                self.dispatched["retried"] += 1
                continue
            header = reply[0]
            if (
                isinstance(header, InferError)
                and header.code in NOT_STARTED
                and not tried
                and deadline - loop.time() > 0.001
                and self._local_link(version_id, [link]) is not None
            ):
                tried.append(link)  # refused unstarted: one more try on another replica
                self.dispatched["retried"] += 1
                continue
            return reply
        if tried:
            raise DispatchError(503, "no serving agent could take the request", 1)
        channels = self.remote.get(version_id)
        if channels and self.remote_sender is not None:
            request.id = next(self._ids)
            request.budget_ms = round(timeout * 1000, 3)
            frame = encode_frame(request, arrays)
            fut: asyncio.Future[AgentReply] = loop.create_future()
            self._remote_pending[request.id] = fut
            self.dispatched["forwarded"] += 1
            channel = random.choice(self._remote_choice(channels, priority))
            self._remote_channel[request.id] = channel
            send = partial(self.remote_sender, channel)
            try:
                await self._send(send, frame)
                return await self._wait(fut, timeout, partial(_cancel, send, request.id))
            except DispatchError as exc:
                # Forwarded: the process holding the agent's connection may have died with it.
                exc.transport = True
                raise
            finally:
                self._remote_pending.pop(request.id, None)
                self._remote_channel.pop(request.id, None)
        links = self._by_version.get(version_id)
        if links:  # every agent serving it here has its breaker open
            now = time.monotonic()
            wait = min(candidate.breaker.retry_after(now) for candidate in links)
            raise DispatchError(503, "every serving agent of this version is failing", wait)
        raise NotReady("no serving agent is ready for this model version", 1)

    def _local_link(
        self, version_id: int, exclude: list[AgentLink], priority: int = INTERACTIVE
    ) -> AgentLink | None:
        """The least loaded link here serving the version whose breaker lets it take work,
        on spot capacity for a batch request and off it for any other when there is a choice."""
        now = time.monotonic()
        links = [
            link
            for link in self._by_version.get(version_id, ())
            if link not in exclude and link.breaker.available(now)
        ]
        if not links:
            return None
        if version_id in self._mixed:
            links = prefer_spot(links, priority)
        return self._pick(links, lambda candidate: len(candidate.pending))

    async def _infer_on(
        self,
        link: AgentLink,
        request: InferRequest,
        arrays: list[np.ndarray],
        timeout: float,
        max_rows: int = 0,
    ) -> AgentReply:
        """One try of a request on one link, its outcome told to the link's breaker: a send
        that failed, or no answer in time, counts against the agent; any answer for it."""
        request.id = next(self._ids)
        request.budget_ms = round(timeout * 1000, 3)
        frame: bytes | Staged
        if link.groups and max_rows > 0 and arrays and arrays[0].ndim:
            frame = Staged(request, arrays, max_rows)  # encoded with its turn's others
        else:
            frame = encode_frame(request, arrays)
        fut: asyncio.Future[AgentReply] = asyncio.get_running_loop().create_future()
        link.pending[request.id] = fut
        link.breaker.begin(time.monotonic())
        self.dispatched["local"] += 1
        try:
            await self._send(link.send_frame, frame)
            reply = await self._wait(fut, timeout, partial(_give_up, link, request.id))
        except DispatchError as exc:
            if (
                isinstance(exc, NotSent)
                or exc.status == 502
                or (exc.status == 504 and timeout >= self.full_budget_s * 0.99)
            ):
                link.breaker.failure(time.monotonic())
            raise
        finally:
            link.pending.pop(request.id, None)
            link.leave_group(request.id)
        link.breaker.success()
        return reply

    async def open_stream(self, request: GenerateRequest) -> StreamInbox:
        """Send a generation to an agent serving the version; its frames arrive on the stream.
        The caller must ``close_stream`` it (after ``cancel`` if it did not run to the end)."""
        request.id = next(self._ids)
        frame = encode_frame(request)
        links = self._by_version.get(request.version_id)
        link: AgentLink | None = None
        if links:
            if request.version_id in self._mixed:
                links = prefer_spot(links, request.priority)
            link = self._pick(links, lambda c: len(c.pending) + len(c.streams))
            stream = link.streams[request.id] = StreamInbox(request.id, link.send_frame)
            self.dispatched["local"] += 1
        elif self.remote.get(request.version_id) and self.remote_sender is not None:
            self.dispatched["forwarded"] += 1
            channels = self._remote_choice(self.remote[request.version_id], request.priority)
            channel = random.choice(channels)
            send = partial(self.remote_sender, channel)
            stream = self._remote_streams[request.id] = StreamInbox(request.id, send)
        else:
            raise NotReady("no serving agent is ready for this model version", 1)
        try:
            await self._send(stream.send, frame)
        except NotSent as exc:
            self.close_stream(stream)
            raise (await ended_as(link, exc) if link is not None else exc) from None
        return stream

    def _remote_choice(self, channels: list[str], priority: int) -> list[str]:
        """The channels a forwarded request chooses among: as ``prefer_spot`` for links."""
        want = priority == BATCH
        own = [c for c in channels if (c in self.remote_spot) == want]
        return own or channels

    def close_stream(self, stream: StreamInbox) -> None:
        self._remote_streams.pop(stream.id, None)
        for link in self._links:
            link.streams.pop(stream.id, None)

    @staticmethod
    async def _send(send: Callable[[Any], Awaitable[None]], frame: bytes | Staged) -> None:
        try:
            await send(frame)
        except Exception as exc:  # a socket closing under us surfaces as several types
            raise NotSent(502, f"could not reach the serving agent: {exc!r}") from None

    async def _wait(
        self,
        fut: asyncio.Future[AgentReply],
        timeout: float,
        give_up: Callable[[], Coroutine[Any, Any, None] | None],
    ) -> AgentReply:
        """The reply; on giving up (the timeout, or this task cancelled because the client
        went away) the agent is told, so it drops the request if it is still queued. The
        agent still answers it (``cancelled``), which also ends the reply route a forwarding
        process keeps for it. The timeout is one entry in ``self.deadlines``, not a timer of
        its own (``Deadlines`` says why)."""
        entry = self.deadlines.add(fut, timeout)
        try:
            return await fut
        except Expired:
            _tell_agent(give_up())
            raise DispatchError(
                504, f"the serving agent did not answer within {timeout:g} s"
            ) from None
        except asyncio.CancelledError:
            _tell_agent(give_up())
            raise
        finally:
            entry[2] = None  # the heap no longer holds the future (nor the reply it holds)

    def deliver(self, link: AgentLink, data: bytes) -> AgentFrame | None:
        """Resolve the request (or feed the stream) a reply frame answers. Returns the frame's
        header when nothing in this process waits for it (it may answer a request forwarded
        from another process); of a ``TokenBatch``, a batch of the chunks nobody here reads."""
        reply = _decode_reply(data)
        if reply is None:
            return None
        header, arrays = reply
        if isinstance(header, TokenBatch):
            others = []
            for chunk in header.chunks:
                if self._feed_chunk(link.streams, chunk):
                    continue
                fut = link.pending.pop(chunk.id, None)
                if fut is None:
                    others.append(chunk)
                else:
                    _answer(fut, chunk, [])  # a stream's text cannot answer a request: 502
            return TokenBatch(others) if others else None
        if header.id in link.streams:
            self._feed(link.streams, header)
            return None
        fut = link.pending.pop(header.id, None)
        if fut is not None:
            _answer(fut, header, arrays)
            return None
        group = link.in_flight.pop(header.id, None)
        if group is None:
            return header
        if isinstance(header, InferResult | InferError):
            link.answer_group(group, header, arrays)
        else:  # a stream's frame cannot answer requests: fail each member (502)
            for member in group.members:
                link.member_of.pop(member.id, None)
                member_fut = link.pending.pop(member.id, None)
                if member_fut is not None:
                    _answer(member_fut, header, [])
        return None

    def deliver_remote(self, data: bytes) -> None:
        """A reply that came back through the channel layer."""
        reply = _decode_reply(data)
        if reply is None:
            return
        header, arrays = reply
        if isinstance(header, TokenBatch):
            for chunk in header.chunks:
                self._feed_chunk(self._remote_streams, chunk)
            return
        if header.id in self._remote_streams:
            self._feed(self._remote_streams, header)
            return
        fut = self._remote_pending.pop(header.id, None)
        if fut is not None:
            _answer(fut, header, arrays)

    @classmethod
    def _feed_chunk(cls, streams: dict[int, StreamInbox], chunk: TokenChunk) -> bool:
        """Feed one chunk of a batch to its stream; False when no stream here reads it."""
        if chunk.id not in streams:
            return False
        cls._feed(streams, chunk)
        return True

    @staticmethod
    def _feed(
        streams: dict[int, StreamInbox],
        header: InferResult | InferError | TokenChunk | GenerateDone,
    ) -> None:
        stream = streams[header.id]
        if isinstance(header, InferResult):
            # A result answers a request, never a stream: the agent broke the protocol.
            stream.fail(DispatchError(502, "the serving agent answered a stream with a result"))
            return
        if isinstance(header, GenerateDone | InferError):
            stream.ended = True  # the agent is done with it: nothing to cancel any more
        if not stream.push(header):
            # The client is not reading: end its stream instead of buffering without bound.
            streams.pop(header.id, None)
            stream.fail(SlowClient(429, "the client read its stream too slowly"))
            in_background(stream.cancel())


def prefer_spot(links: list[AgentLink], priority: int) -> list[AgentLink]:
    """The links a request should choose among: batch-class work goes to spot capacity and
    everything else stays off it, each falling back to the other kind when none of its own
    serves the version. A list filter, no database: ``AgentLink.spot`` came with the link."""
    want = priority == BATCH
    own = [link for link in links if link.spot == want]
    return own or links


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def _give_up(link: AgentLink, request_id: int) -> Coroutine[Any, Any, None] | None:
    """A request on ``link`` stopped waiting: the cancel to send for it (of its group once
    no member of it waits any more; none while one does). Decided at once, before the
    request's own clean-up forgets which group it was in."""
    target = link.leave_group(request_id)
    return None if target is None else _cancel(link.send_frame, target)


def _tell_agent(cancel: Coroutine[Any, Any, None] | None) -> None:
    if cancel is not None:
        in_background(cancel)


async def _cancel(send: Callable[[bytes], Awaitable[None]], request_id: int) -> None:
    try:
        await send(encode_frame(CancelGenerate(id=request_id)))
    except Exception as exc:  # the agent (or Redis) may be gone; nothing left to stop then
        log.info("could not cancel request %d: %r", request_id, exc)


def _answer(fut: asyncio.Future[AgentReply], header: AgentFrame, arrays: list[np.ndarray]) -> None:
    """Resolve a request with the agent's answer; a stream's frame is not an answer."""
    if fut.done():
        return
    if isinstance(header, InferResult | InferError):
        fut.set_result((header, arrays))
    else:
        fut.set_exception(
            DispatchError(
                502, f"the serving agent answered a request with a {type(header).__name__} frame"
            )
        )


def _decode_reply(data: bytes) -> tuple[AgentFrame, list[np.ndarray]] | None:
    try:
        header, arrays = decode_frame(data)
    except FrameError as exc:
        log.warning("dropping an undecodable frame from an agent: %s", exc)
        return None
    if isinstance(header, InferRequest | GenerateRequest | CancelGenerate):
        log.warning("dropping a %s frame sent by an agent", type(header).__name__)
        return None
    return header, arrays


_background: set[asyncio.Task[None]] = set()


def in_background(coro: Coroutine[Any, Any, None]) -> None:
    """Run work after the reply (shadow copies, cancels), keeping a reference until it ends."""
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)  # a reference, so the task is not garbage collected
    task.add_done_callback(_background.discard)
