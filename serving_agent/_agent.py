"""The agent: its connection, its set of loaded versions and its request serving, wired together;
it routes what the platform sends and builds the heartbeats."""

from __future__ import annotations

import asyncio
import json
import logging
from functools import partial

from pydantic import ValidationError

from ._cache import ArtifactCache
from ._connection import Connection, ws_url
from ._facts import node_facts
from ._links import DataLinks
from ._memory import gpu_use
from ._serving import Serving
from ._versions import VersionSet
from .protocol import Assign, Heartbeat, Hello, Links, VersionStatus

logger = logging.getLogger(__name__)


class Agent:
    """Serves the versions the platform assigns, over one websocket at a time.

    The connection hands each message to the agent, which routes assignments to ``versions``
    and frames to ``serving``. Both answer through the connection without knowing it: the
    versions through ``report_status``, serving through the connection's ``send_frames``.
    Serving only reads which versions are loaded.
    """

    def __init__(
        self,
        platform: str,
        token: str,
        cache: ArtifactCache,
        *,
        threads: int = 1,
        name: str | None = None,
        retry_base: float = 0.5,
        retry_cap: float = 10.0,
        auth_retry_s: float = 60.0,
        stable_s: float = 10.0,
        deployment: str | None = None,
        memory_budget_bytes: int = 0,
        cold_after_s: float = 30.0,
    ) -> None:
        self.platform = platform.rstrip("/")
        self.cache = cache
        self.name = name
        self.deployment = deployment
        self.memory_budget_bytes = memory_budget_bytes  # 0 until hello(): the node's default
        self.headers = {"Authorization": f"Bearer {token}"}
        self._hello: Hello | None = None
        self.connection = Connection(
            ws_url(platform),
            self.headers,
            self,
            hello=self.hello,
            heartbeat=self.heartbeat,
            retry_base=retry_base,
            retry_cap=retry_cap,
            auth_retry_s=auth_retry_s,
            stable_s=stable_s,
        )
        self.versions = VersionSet(
            cache,
            self.report_status,
            platform=self.platform,
            headers=self.headers,
            memory_budget=self.memory_budget,
            threads=threads,
            cold_after_s=cold_after_s,
        )
        self.serving = Serving(self.versions.loaded, self.connection)
        self.links = DataLinks(
            self.connection.url,
            self.headers,
            self.versions.loaded,
            self.serving.stats,
            retry_base=retry_base,
            retry_cap=retry_cap,
            auth_retry_s=auth_retry_s,
            stable_s=stable_s,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Connect and serve until ``stop`` is set, reconnecting with backoff; then unload all."""
        try:
            await self.connection.run(stop)
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop serving, unload everything and wait for background work; the agent is done
        afterwards."""
        await self.links.close()
        await self.serving.shutdown()
        await self.versions.shutdown()

    # What the connection hands over -----------------------------------------------------------

    def handle_control(self, text: str) -> None:
        try:
            data = json.loads(text)
            kind = data.get("type") if isinstance(data, dict) else None
        except ValueError:
            kind = None
        if kind not in ("assign", "links"):
            logger.warning("ignoring control message of type %r", kind)
            return
        try:
            message = (Assign if kind == "assign" else Links).model_validate(data)
        except ValidationError as exc:
            logger.error("ignoring invalid %s: %s", kind, exc)
            return
        if isinstance(message, Assign):
            self.apply_assign(message)
        else:
            self.links.update(message)

    def handle_frame(self, frame: bytes) -> None:
        self.serving.handle_frame(frame)

    def disconnected(self) -> None:
        self.serving.drop_connection()

    def apply_assign(self, assign: Assign) -> None:
        """Converge on the assigned set, and send heartbeats as often as the platform asks."""
        self.connection.set_heartbeat_interval(assign.heartbeat_s)
        self.versions.apply(assign)

    # What goes to the platform ----------------------------------------------------------------

    async def hello(self) -> Hello:
        if self._hello is None:  # nvidia-smi is slow and the facts do not change
            self._hello = await asyncio.to_thread(
                partial(
                    node_facts,
                    self.name,
                    deployment=self.deployment,
                    memory_budget_bytes=self.memory_budget_bytes,
                )
            )
            self.memory_budget_bytes = self._hello.memory_budget_bytes
        return self._hello

    async def memory_budget(self) -> int:
        """The memory loaded versions may fill: the one given, else the node's default."""
        return (await self.hello()).memory_budget_bytes

    async def report_status(self, status: VersionStatus) -> None:
        await self.connection.send(status.model_dump_json())

    def heartbeat(self) -> Heartbeat:
        stats, versions = self.serving.stats, self.versions
        p50, p99 = stats.percentiles_ms()
        generation = versions.generation_totals()
        return Heartbeat(
            queue_depth=versions.queue_depth(),
            in_flight=stats.in_flight,
            load_avg=round(stats.load_avg(), 3),
            requests_total=stats.requests_total,
            errors_total=stats.errors_total,
            p50_ms=p50,
            p99_ms=p99,
            streams_active=versions.streams_active(),
            decode_steps_total=generation.decode_steps_total,
            max_decode_batch=generation.max_decode_batch,
            streams_cancelled_total=generation.streams_cancelled_total,
            tokens_generated_total=generation.tokens_generated_total,
            memory_budget_bytes=self.memory_budget_bytes,
            memory_used_bytes=versions.memory_used(),
            versions=versions.loads(),
            evicted=sorted(versions.evicted),
            gpus=gpu_use(),
            batch_size_counts=versions.batch_sizes.counts,
            batch_rows_total=versions.batch_sizes.rows_total,
            expired_total=versions.sched_counts.expired,
            cancelled_total=versions.sched_counts.cancelled,
            shed_total=versions.sched_counts.shed,
        )
