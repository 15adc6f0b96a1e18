"""Per-process state of the data path: caches, the agent pool, the rate limiter.

Keys, quotas and routes are cached in process so a warm request touches no database. A
refresh loop polls the config generation (see ``gateway.changes``) and drops the caches when it
moves, pushes new assignments to the agents this process holds, learns where agents held by
other processes are, and writes API-key last-used times in bulk.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from datetime import datetime

from channels.db import database_sync_to_async
from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.conf import settings
from django.utils import timezone

from rollouts.routing import Split, active_split
from rollouts.shadow import record_shadow
from tenants.keys import KeyIdentity, identify_key, record_key_use
from tenants.ratelimit import LocalLimiter, RedisLeaseLimiter

from . import nodes
from .changes import read_generation
from .dispatch import AgentPool
from .routes import DEFAULT_ALIAS, Route, RouteMissing, resolve_route, resolve_version_id
from .stream_budget import LocalStreamBudget, RedisStreamBudget, StreamBudget
from .traffic import TrafficCounter, save_samples

log = logging.getLogger(__name__)

MAX_CACHED = 10_000  # bound for caches keyed by caller input (unknown keys, model names)
FLUSH_S = 5.0  # key last-used times and traffic samples are written this often


class GatewayState:
    def __init__(self) -> None:
        self.pool = AgentPool()
        cfg = settings.SWITCHYARD
        self.limiter: LocalLimiter | RedisLeaseLimiter = (
            RedisLeaseLimiter(settings.REDIS_URL, cfg["RATE_LEASE_FRACTION"])
            if settings.REDIS_URL
            else LocalLimiter()
        )
        self.infer_timeout = cfg["INFER_TIMEOUT_S"]
        self.max_body = cfg["MAX_BODY_BYTES"]
        self._interval = cfg["REFRESH_INTERVAL_S"]
        self._keys: dict[str, KeyIdentity | None] = {}
        self._routes: dict[tuple[int, str, int | None], Route | str] = {}
        self._splits: dict[tuple[int, str], Split | None] = {}
        self._by_id: dict[tuple[int, int], Route] = {}
        self.traffic = TrafficCounter()
        # Text generation: each tenant's concurrent streams and tokens per minute.
        self.streams: StreamBudget = (
            RedisStreamBudget(settings.REDIS_URL) if settings.REDIS_URL else LocalStreamBudget()
        )
        # Shadow comparisons per plan: [copies answered, agreeing with the baseline, failed].
        self.shadow_stats: dict[int, list[int]] = {}
        self._generation: int | None = None
        self._key_use: dict[int, datetime] = {}
        self._last_flush = time.monotonic()
        self._task: asyncio.Task | None = None
        self._reply_task: asyncio.Task | None = None
        self.agent_consumers: set = set()  # AgentConsumer instances held by this process

    # Cached lookups ----------------------------------------------------------------------------
    async def identify(self, raw_key: str) -> KeyIdentity | None:
        try:
            identity = self._keys[raw_key]
        except KeyError:
            identity = await database_sync_to_async(identify_key)(raw_key)
            self._remember(self._keys, raw_key, identity)
        if identity is not None:
            self._key_use[identity.key_id] = timezone.now()
        return identity

    async def route(self, tenant_id: int, model_name: str, version: int | None) -> Route:
        key = (tenant_id, model_name, version)
        try:
            found = self._routes[key]
        except KeyError:
            try:
                found = await database_sync_to_async(resolve_route)(*key)
            except RouteMissing as exc:
                found = str(exc)
            self._remember(self._routes, key, found)
        if isinstance(found, str):
            raise RouteMissing(found)
        return found

    async def split(self, tenant_id: int, model_name: str) -> Split | None:
        """The active rollout split of a model's production alias, if any (cached)."""
        key = (tenant_id, model_name)
        try:
            return self._splits[key]
        except KeyError:
            found = await database_sync_to_async(active_split)(tenant_id, model_name, DEFAULT_ALIAS)
            self._remember(self._splits, key, found)
            return found

    async def version_route(self, tenant_id: int, version_id: int) -> Route:
        try:
            return self._by_id[(tenant_id, version_id)]
        except KeyError:
            found = await database_sync_to_async(resolve_version_id)(tenant_id, version_id)
            self._remember(self._by_id, (tenant_id, version_id), found)
            return found

    @staticmethod
    def _remember(cache: dict, key: object, value: object) -> None:
        if len(cache) >= MAX_CACHED:
            cache.clear()
        cache[key] = value

    def clear_caches(self) -> None:
        self._keys.clear()
        self._routes.clear()
        self._splits.clear()
        self._by_id.clear()

    # Background refresh ------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh_once()
            except Exception:  # a database blip must not stop the loop for good
                log.exception("gateway refresh failed; retrying")
            await asyncio.sleep(self._interval)

    async def refresh_once(self) -> None:
        generation = await database_sync_to_async(read_generation)()
        if generation != self._generation:
            first = self._generation is None
            self._generation = generation
            if not first:
                self.clear_caches()
                for consumer in list(self.agent_consumers):
                    await consumer.push_assignment()
        await self._refresh_remote_agents()
        if time.monotonic() - self._last_flush > FLUSH_S:
            self._last_flush = time.monotonic()
            used, self._key_use = self._key_use, {}
            if used:
                await database_sync_to_async(record_key_use)(used)
            counts = self.traffic.drain()
            if counts:
                await database_sync_to_async(save_samples)(counts)
            shadows, self.shadow_stats = self.shadow_stats, {}
            if shadows:
                await database_sync_to_async(record_shadow)(shadows)

    async def _refresh_remote_agents(self) -> None:
        layer = get_channel_layer()
        if layer is None or isinstance(layer, InMemoryChannelLayer):
            return  # one process: every agent is local
        local = self.pool.local_channel_names()
        remote: dict[int, list[str]] = {}
        for channel, ready in await database_sync_to_async(nodes.live_sessions)():
            if channel not in local:
                for vid in ready:
                    remote.setdefault(vid, []).append(channel)
        self.pool.remote = remote
        if remote and self._reply_task is None:
            await self._start_reply_listener(layer)

    async def _start_reply_listener(self, layer) -> None:
        channel = await layer.new_channel("gateway.")

        async def send(agent_channel: str, frame: bytes) -> None:
            await layer.send(
                agent_channel, {"type": "agent.forward", "frame": frame, "reply": channel}
            )

        async def listen() -> None:
            while True:
                message = await layer.receive(channel)
                self.pool.deliver_remote(message["frame"])

        self.pool.remote_sender = send
        self._reply_task = asyncio.get_running_loop().create_task(listen())


_states: dict[asyncio.AbstractEventLoop, GatewayState] = {}


def get_state() -> GatewayState:
    """This event loop's gateway state (one loop per server process in production)."""
    loop = asyncio.get_running_loop()
    state = _states.get(loop)
    if state is None:
        state = _states[loop] = GatewayState()
        state.start()
        # Move everything loaded so far (Django, apps, numpy, onnx) out of the collector's
        # view: full collections over that heap were the 99th-percentile latency spikes
        # (~70 ms) under load.
        gc.freeze()
    return state
