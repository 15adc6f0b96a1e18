"""The agent's data links: a websocket to every other gateway process.

The main connection lands on one gateway process. That process tells the agent the other
processes' link addresses (``Links``); the agent keeps one data link open to each, so a request
reaches it from the process that received it, without a hop through Redis. A data link only
carries requests and replies: it attaches to the main connection's session, and the platform
takes which versions it may be sent from that session, never from the link.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any
from urllib.parse import urlsplit

from ._connection import Connection
from ._serving import Serving, Stats
from ._versions import Loaded, LoadedTextGen
from .protocol import Attach, Detach, Links

logger = logging.getLogger(__name__)

# A data link no longer asked for is retired, not dropped (DataLink.retire): this long after the
# new Links, the platform is told to send nothing new on it; what was sent is answered within
# RETIRE_MAX_S (past any request's deadline on the platform), then it closes.
RETIRE_GRACE_S = 0.5
RETIRE_MAX_S = 30.0


class DataLink:
    """One data link, reopened with backoff until closed; it serves with a ``Serving`` of its
    own (its replies go back on it) over the agent's loaded versions and shared stats."""

    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        loaded: Mapping[int, Loaded | LoadedTextGen],
        stats: Stats,
        session: int,
        **retry: float,
    ) -> None:
        self.url = url
        self.session = session
        self.connection = Connection(url, headers, self, hello=self.attach, heartbeat=None, **retry)
        self.serving = Serving(loaded, self.connection, stats)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.connection.run(self._stop), name=f"link {url}")

    async def attach(self) -> Attach:
        return Attach(session=self.session, groups=True)

    async def reattach(self, session: int) -> None:
        """The main connection has a new session: serve its versions from now on (sent on the
        open link; a link reopening later attaches with it anyway)."""
        self.session = session
        await self.connection.send(Attach(session=session, groups=True).model_dump_json())

    async def close(self) -> None:
        self._stop.set()
        await self._task
        await self.serving.shutdown()

    async def retire(self) -> None:
        """Close without failing what the link carries: after ``RETIRE_GRACE_S`` (the main
        connection's statuses reach its gateway process first, so the version stays servable
        there), ask the platform to send nothing new (``Detach``); once what it sent before
        reading that has arrived (another grace) and is answered (at most ``RETIRE_MAX_S``),
        close."""
        await asyncio.sleep(RETIRE_GRACE_S)
        await self.connection.send(Detach().model_dump_json())
        # Requests the platform sent before it read the Detach are still on their way here.
        await asyncio.sleep(RETIRE_GRACE_S)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETIRE_MAX_S
        while self.serving.busy and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.close()

    # What the connection hands over ------------------------------------------------------------

    def handle_control(self, text: str) -> None:
        logger.warning("ignoring a control message on the data link to %s", self.url)

    def handle_frame(self, frame: bytes) -> None:
        self.serving.handle_frame(frame)

    def disconnected(self) -> None:
        self.serving.drop_connection()


class DataLinks:
    """The data links the main connection's latest ``Links`` asks for."""

    def __init__(
        self,
        main_url: str,
        headers: dict[str, str],
        loaded: Mapping[int, Loaded | LoadedTextGen],
        stats: Stats,
        **retry: float,
    ) -> None:
        # The token goes to every link address: never in clear when the main connection is not.
        self.secure_only = main_url.startswith("wss://")
        self.headers = headers
        self.loaded = loaded
        self.stats = stats
        self.retry = retry
        self.links: dict[str, DataLink] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def update(self, links: Links) -> None:
        """Open links to new addresses, close those no longer listed, re-attach the rest."""
        wanted = {url for url in links.urls if self._allowed(url)}
        for url in list(self.links):
            if url not in wanted:
                self._background(self.links.pop(url).retire())
        for url in sorted(wanted):
            link = self.links.get(url)
            if link is None:
                self.links[url] = DataLink(
                    url, self.headers, self.loaded, self.stats, links.session, **self.retry
                )
            elif link.session != links.session:
                self._background(link.reattach(links.session))

    def _allowed(self, url: str) -> bool:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            logger.warning("ignoring the link address %r", url)
            return False
        if self.secure_only and parts.scheme != "wss":
            logger.warning("ignoring %s: the main connection is wss, this link would not be", url)
            return False
        return True

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        links, self.links = list(self.links.values()), {}
        await asyncio.gather(*(link.close() for link in links), *self._tasks)
