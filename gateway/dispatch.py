"""Handing inference requests to serving agents and matching their replies.

An ``AgentPool`` lives in each gateway process (one per event loop). It knows the agent
connections this process holds (``AgentLink``) and which versions each has ready, and picks
the one with the fewest outstanding requests. A request goes straight to that socket, in
process; only when no agent here serves the version does it travel through the channel layer
(Redis) to the process that holds one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from serving_agent.protocol import (
    FrameError,
    InferError,
    InferRequest,
    InferResult,
    decode_frame,
    encode_frame,
    pack_frames,
    tensor_of,
)

log = logging.getLogger(__name__)

Reply = tuple[InferResult | InferError, list[np.ndarray]]


class DispatchError(Exception):
    """The request could not be served; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@dataclass(eq=False)
class AgentLink:
    """One agent websocket held by this process."""

    name: str
    send_message: Callable[[bytes], Awaitable[None]]
    ready: set[int] = field(default_factory=set)
    pending: dict[int, asyncio.Future[Reply]] = field(default_factory=dict)
    outbox: list[bytes] = field(default_factory=list)

    async def send_frame(self, frame: bytes) -> None:
        """Queue a frame; the first sender of an event-loop turn sends the turn's frames as one
        websocket message (see ``serving_agent.protocol.pack_frames``)."""
        self.outbox.append(frame)
        if len(self.outbox) > 1:
            return  # an earlier request of this turn is already the flusher
        await asyncio.sleep(0)  # let the rest of this turn's requests queue their frames
        frames, self.outbox = self.outbox, []
        await self.send_message(pack_frames(frames))


class AgentPool:
    def __init__(self) -> None:
        self._links: list[AgentLink] = []
        self._by_version: dict[int, list[AgentLink]] = {}
        # Ids are unique across processes, so an agent reached through the channel layer can
        # be handed requests from several gateways without renumbering them.
        self._ids = itertools.count((random.getrandbits(20) << 32) + 1)
        # Filled by the gateway's refresh loop: version id -> channel names in other processes.
        self.remote: dict[int, list[str]] = {}
        self.remote_sender: Callable[[str, bytes], Awaitable[None]] | None = None
        self._remote_pending: dict[int, asyncio.Future[Reply]] = {}

    # Links -------------------------------------------------------------------------------------
    def add(self, link: AgentLink) -> None:
        self._links.append(link)

    def set_ready(self, link: AgentLink, version_id: int, ready: bool) -> None:
        (link.ready.add if ready else link.ready.discard)(version_id)
        self._reindex()

    def remove(self, link: AgentLink, reason: str) -> None:
        """Forget a link and fail its outstanding requests at once."""
        if link in self._links:
            self._links.remove(link)
            self._reindex()
        for fut in link.pending.values():
            if not fut.done():
                fut.set_exception(DispatchError(502, reason))
        link.pending.clear()

    def _reindex(self) -> None:
        index: dict[int, list[AgentLink]] = {}
        for link in self._links:
            for vid in link.ready:
                index.setdefault(vid, []).append(link)
        self._by_version = index

    def is_ready(self, version_id: int) -> bool:
        return bool(self._by_version.get(version_id) or self.remote.get(version_id))

    def local_channel_names(self) -> set[str]:
        return {link.name for link in self._links}

    # Requests ----------------------------------------------------------------------------------
    async def infer(
        self,
        version_id: int,
        names: list[str],
        arrays: list[np.ndarray],
        outputs: list[str] | None,
        timeout: float,
    ) -> Reply:
        """Send one request to an agent serving the version and wait for its reply."""
        request_id = next(self._ids)
        frame = encode_frame(
            InferRequest(
                id=request_id,
                version_id=version_id,
                inputs=[tensor_of(n, a) for n, a in zip(names, arrays, strict=True)],
                outputs=outputs,
            ),
            arrays,
        )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reply] = loop.create_future()
        links = self._by_version.get(version_id)
        if links:
            link = min(links, key=lambda candidate: len(candidate.pending))
            link.pending[request_id] = fut
            try:
                await self._send(link.send_frame, frame)
                return await self._wait(fut, timeout)
            finally:
                link.pending.pop(request_id, None)
        channels = self.remote.get(version_id)
        if channels and self.remote_sender is not None:
            self._remote_pending[request_id] = fut
            try:
                await self._send(partial(self.remote_sender, random.choice(channels)), frame)
                return await self._wait(fut, timeout)
            finally:
                self._remote_pending.pop(request_id, None)
        raise DispatchError(503, "no serving agent is ready for this model version", 1)

    @staticmethod
    async def _send(send: Callable[[bytes], Awaitable[None]], frame: bytes) -> None:
        try:
            await send(frame)
        except Exception as exc:  # a socket closing under us surfaces as several types
            raise DispatchError(502, f"could not reach the serving agent: {exc!r}") from None

    @staticmethod
    async def _wait(fut: asyncio.Future[Reply], timeout: float) -> Reply:
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            raise DispatchError(
                504, f"the serving agent did not answer within {timeout:g} s"
            ) from None

    def deliver(self, link: AgentLink, data: bytes) -> int | None:
        """Resolve the request a reply frame answers. Returns the reply's id when no request
        of this process waits for it (it may answer one forwarded from another process)."""
        reply = _decode_reply(data)
        if reply is None:
            return None
        fut = link.pending.pop(reply[0].id, None)
        if fut is None:
            return reply[0].id
        if not fut.done():
            fut.set_result(reply)
        return None

    def deliver_remote(self, data: bytes) -> None:
        """A reply that came back through the channel layer."""
        reply = _decode_reply(data)
        if reply is None:
            return
        fut = self._remote_pending.pop(reply[0].id, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)


def _decode_reply(data: bytes) -> Reply | None:
    try:
        header, arrays = decode_frame(data)
    except FrameError as exc:
        log.warning("dropping an undecodable frame from an agent: %s", exc)
        return None
    if isinstance(header, InferRequest):
        log.warning("dropping an inference request sent by an agent")
        return None
    return header, arrays


def error_frame(request_id: int, message: str) -> bytes:
    return encode_frame(InferError(id=request_id, code="internal", message=message))
