"""Per-process state of the data path: caches, the agent pool, the rate limiter.

Keys, quotas and routes are cached in process so a warm request touches no database. A
refresh loop polls the config generation (see ``fleet.changes``); when it moves, it reads the
changes since and drops only the entries they touch (a key's identity, a tenant's, a model's
routes), pushes new assignments to the agents this process holds, learns where agents held by
other processes are, and writes API-key last-used times in bulk.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from channels.layers import BaseChannelLayer, InMemoryChannelLayer, get_channel_layer
from django.conf import settings
from django.db import DatabaseError

from fleet import coldstart, gateways, nodes
from fleet.changes import Change, changes_since
from fleet.models import ChangeKind
from monitoring.budgets import stopped_tenants
from monitoring.traffic import TrafficCounter, save_samples
from rollouts.routing import Split, active_split
from rollouts.shadow import record_shadow
from tenants.keys import KeyIdentity, identify_key, record_key_use
from tenants.ratelimit import InFlightLimit, LocalLimiter, RedisLeaseLimiter
from tenants.stream_budget import LocalStreamBudget, RedisStreamBudget, StreamBudget

from .breakers import Breaker
from .db import database_stamp, db_call
from .dispatch import AgentLink, AgentPool, DispatchError, NotReady
from .genlog import GenerationLogger
from .idempotency import AnswerStore, answer_store
from .links import LinkListener
from .metrics import COLD_START_WAIT, Observed, RequestMetrics, fold_dispatched
from .predlog import PredictionLogger
from .routes import Route, RouteMissing, resolve_route, resolve_version_id

log = logging.getLogger(__name__)

MAX_CACHED = 10_000  # bound for caches keyed by caller input (unknown keys, model names)
FLUSH_S = 5.0  # key last-used times and traffic samples are written this often
WAKE_EVERY_S = 5.0  # a held cold start re-marks its deployment this often (the autoscaler's
# pending signal), and a version is woken at most this often however many requests wait
COLD_RETRY_AFTER_S = 5  # Retry-After of a cold start that outlasted the hold
DB_RETRY_AFTER_S = 1  # Retry-After of a request whose lookup the database did not answer
# A process whose refresh has not reached the database for this long, and that holds no ready
# agent link, says it is not ready (/v2/health/ready): it can serve nothing.
READY_STALE_S = 30.0
# Where the database's files show that nothing was written (SQLite), the refresh still reads
# this often: the budgets' stops also follow the calendar (a new month lifts them).
QUIET_READ_S = 30.0
# A process that answered no prediction for REST_AFTER_S refreshes every REST_INTERVAL_S.
REST_AFTER_S = 10.0
REST_INTERVAL_S = 1.0


@dataclass
class SharedRead:
    """What one refresh reads from the database, in one trip to a database thread."""

    generation: int
    changes: list[Change] | None
    agents: list[nodes.LiveAgent] | None  # with several processes only
    budget_stops: dict[int, str] | None  # when due


def read_shared(seen: int | None, several: bool, budgets: bool) -> SharedRead:
    generation, changes = changes_since(seen)
    return SharedRead(
        generation,
        changes,
        nodes.live_agents() if several else None,
        stopped_tenants() if budgets else None,
    )


T = TypeVar("T")
_K = TypeVar("_K")  # a cache's key and value (_remember)
_V = TypeVar("_V")

Progress = Callable[[dict[str, Any]], Awaitable[None]]


class GatewayState:
    def __init__(self) -> None:
        self.pool = AgentPool(
            settings.SWITCHYARD_BREAKER_FAILURES, settings.SWITCHYARD_BREAKER_COOLDOWN_S
        )
        self.limiter: LocalLimiter | RedisLeaseLimiter = (
            RedisLeaseLimiter(settings.REDIS_URL, settings.SWITCHYARD_RATE_LEASE_FRACTION)
            if settings.REDIS_URL
            else LocalLimiter()
        )
        self.in_flight = InFlightLimit()  # each API key's requests at once in this process
        self.infer_timeout = settings.SWITCHYARD_INFER_TIMEOUT_S
        self.pool.full_budget_s = self.infer_timeout
        # One breaker per version (gateway.breakers): a version failing every request on
        # every agent is skipped for the next step of its model's fallback ladder.
        self.version_breakers: dict[int, Breaker] = {}
        # First answers to inference sent with an Idempotency-Key (Redis, or this process).
        self.answers: AnswerStore = answer_store()
        self.max_body = settings.SWITCHYARD_MAX_BODY_BYTES
        self._interval = settings.SWITCHYARD_REFRESH_INTERVAL_S
        self._keys: dict[str, KeyIdentity | None] = {}
        # Keyed by (tenant, model, version number or alias name) and (tenant, model, alias).
        self._routes: dict[tuple[int, str, int | str], Route | str] = {}
        self._splits: dict[tuple[int, str, str], Split | None] = {}
        self._by_id: dict[tuple[int, int], Route] = {}
        self.traffic = TrafficCounter()
        # Folded into prometheus-client by the refresh loop.
        self.metrics = RequestMetrics(stage_every=settings.SWITCHYARD_STAGE_SAMPLE)
        self.count_metrics = settings.SWITCHYARD_REQUEST_METRICS
        self.log_predictions = settings.SWITCHYARD_PREDICTION_LOG
        self.predlog = PredictionLogger()
        self.genlog = GenerationLogger()
        # Text generation: each tenant's concurrent streams and tokens per minute.
        self.streams: StreamBudget = (
            RedisStreamBudget(settings.REDIS_URL) if settings.REDIS_URL else LocalStreamBudget()
        )
        # Shadow comparisons per plan: [copies answered, agreeing with the baseline, failed].
        self.shadow_stats: dict[int, list[int]] = {}
        # Tenants whose budget's hard stop refuses new work, and what they are told: reread
        # every SWITCHYARD_BUDGET_REFRESH_S, so a request costs a dict lookup, no query.
        self.budget_stops: dict[int, str] = {}
        self._budgets_read = 0.0
        self.served_at = -math.inf  # time.perf_counter() of the last prediction answered
        # The SQLite files' stamp at the last read (gateway.db.database_stamp), and when.
        self._stamp: tuple[int, ...] | None = None
        self._read_at = 0.0
        self._generation: int | None = None
        self._key_use: dict[int, datetime] = {}
        self._last_flush = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._reply_task: asyncio.Task[None] | None = None
        self.agent_consumers: set[Any] = set()  # AgentConsumer instances held by this process
        # This process's address for agents' data links (None: agents reach it only through
        # their main connection), and the other live processes' addresses.
        self.link_listener: LinkListener | None = None
        self.other_gateways: list[str] = []
        self._gateways_checked = 0.0
        self.refreshed_at: float | None = None  # time.monotonic() of the last whole refresh
        self.cold_start_hold_s = settings.SWITCHYARD_COLD_START_HOLD_S
        # version id -> (when this process last woke it, the call saying if it is deployed)
        self._woken: dict[int, tuple[float, asyncio.Future[bool]]] = {}
        # Bumped whenever cached entries are dropped: a lookup that overlapped a drop does not
        # cache its answer, which may predate the change (a key revoked while it was looked up).
        self._drops = 0

    # Cached lookups ----------------------------------------------------------------------------
    async def identify(self, raw_key: str, used: bool = True) -> KeyIdentity | None:
        """The key's identity, from the cache (dropped within a refresh interval of a change
        such as a revocation); ``used=False`` for a re-check that is not a use of the key."""
        try:
            identity = self._keys[raw_key]
        except KeyError:
            drops = self._drops
            identity = await lookup(identify_key, raw_key)
            self._remember(self._keys, raw_key, identity, drops)
        if identity is not None and used:
            # timezone.now() without its read of settings.USE_TZ (on, always, here)
            self._key_use[identity.key_id] = datetime.now(UTC)
        return identity

    async def route(self, tenant_id: int, model_name: str, target: int | str) -> Route:
        """The route of a version number or an alias name (cached, misses too)."""
        key = (tenant_id, model_name, target)
        try:
            found = self._routes[key]
        except KeyError:
            drops = self._drops
            try:
                found = await lookup(resolve_route, *key)
            except RouteMissing as exc:
                found = str(exc)
            self._remember(self._routes, key, found, drops)
        if isinstance(found, str):
            raise RouteMissing(found)
        return found

    async def split(self, tenant_id: int, model_name: str, alias: str) -> Split | None:
        """The active rollout split of one alias of a model, if any (cached)."""
        key = (tenant_id, model_name, alias)
        try:
            return self._splits[key]
        except KeyError:
            drops = self._drops
            found = await lookup(active_split, *key)
            self._remember(self._splits, key, found, drops)
            return found

    async def version_route(self, tenant_id: int, version_id: int) -> Route:
        try:
            return self._by_id[(tenant_id, version_id)]
        except KeyError:
            drops = self._drops
            found = await lookup(resolve_version_id, tenant_id, version_id)
            self._remember(self._by_id, (tenant_id, version_id), found, drops)
            return found

    async def ready(
        self,
        version_id: int,
        progress: Progress | None = None,
        route: Route | None = None,
        tenant: str = "",
    ) -> None:
        """Return once a replica of the version is ready to serve it (at once when warm).

        A cold start (a deployed version with no ready replica, e.g. scaled to zero) wakes
        the deployment and holds the request up to ``COLD_START_HOLD_S``, reporting
        ``progress`` about once a second; past the hold it raises 503 with Retry-After. A
        version with no deployment returns at once: dispatch answers for it as before.
        With the request's ``route`` and ``tenant`` (slug), the hold is observed in
        ``switchyard_cold_start_wait_seconds``: on the cold path only, so a warm request pays
        nothing for it.
        """
        if self.pool.is_ready(version_id):
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        if not await self._wake(version_id):
            return
        next_report = started
        outcome = "abandoned"  # unless the loop ends or times out: the client left (cancelled)
        try:
            while not self.pool.is_ready(version_id):
                now = loop.time()
                if now - started >= self.cold_start_hold_s:
                    outcome = "timed_out"
                    raise NotReady(
                        f"the model version is starting (cold start) and was not ready within "
                        f"{self.cold_start_hold_s:g} s; retry shortly",
                        COLD_RETRY_AFTER_S,
                    )
                if progress is not None and now >= next_report:
                    report = await db_call(coldstart.cold_start_progress)(version_id)
                    await progress(report | {"elapsed_s": round(now - started, 1)})
                    next_report = now + 1.0
                await self._wake(version_id)
                await asyncio.sleep(0.05)
            outcome = "ready"
        finally:
            if route is not None:
                labels = (tenant, route.model_name, str(route.version), outcome)
                COLD_START_WAIT.labels(*labels).observe(loop.time() - started)

    async def _wake(self, version_id: int) -> bool:
        """Mark the version's deployment woken, at most every WAKE_EVERY_S however many
        requests wait (they share one call); False when it has none."""
        now = time.monotonic()
        entry = self._woken.get(version_id)
        if entry is None or now - entry[0] >= WAKE_EVERY_S:
            call = asyncio.ensure_future(db_call(coldstart.wake)(version_id))
            entry = (now, call)
            self._remember(self._woken, version_id, entry, self._drops)
        try:
            return await asyncio.shield(entry[1])
        except Exception:  # the database is down: answer as for a version nobody serves
            log.exception("could not wake the deployment of version %s", version_id)
            return False

    def _remember(self, cache: dict[_K, _V], key: _K, value: _V, drops: int) -> None:
        """Cache ``value``, looked up when the drop count was ``drops``, unless entries were
        dropped since: then the answer may predate the change that dropped them."""
        if drops != self._drops:
            return
        if len(cache) >= MAX_CACHED:
            cache.clear()
        cache[key] = value

    def clear_caches(self) -> None:
        self._drops += 1
        self._keys.clear()
        self._routes.clear()
        self._splits.clear()
        self._by_id.clear()

    def forget(self, changes: list[Change] | None) -> bool:
        """Drop the cached entries these changes touch (None: changes this process can no
        longer read, so every entry); returns whether agents' assignments may have moved (any
        change but a key's). One pass over each cache, however many changes."""
        if changes is None or any(c.kind == ChangeKind.ALL for c in changes):
            self.clear_caches()
            return True
        self._drops += 1
        key_ids = {c.object_id for c in changes if c.kind == ChangeKind.KEY}
        tenants = {c.tenant_id for c in changes if c.kind == ChangeKind.TENANT}
        model_ids = {c.object_id for c in changes if c.kind == ChangeKind.MODEL}
        # By name too: a model created (or renamed) under a name cached as missing.
        names = {(c.tenant_id, c.name) for c in changes if c.kind == ChangeKind.MODEL}
        if key_ids or tenants:
            for raw, identity in list(self._keys.items()):
                if identity is None:  # unknown or revoked: a key change may have made it known
                    stale = bool(key_ids)
                else:
                    stale = identity.key_id in key_ids or identity.tenant_id in tenants
                if stale:
                    del self._keys[raw]
        if tenants or model_ids:
            for key, found in list(self._routes.items()):
                if (
                    key[0] in tenants
                    or key[:2] in names
                    or (isinstance(found, Route) and found.model_id in model_ids)
                ):
                    del self._routes[key]
            for split_key in list(self._splits):
                if split_key[0] in tenants or split_key[:2] in names:
                    del self._splits[split_key]
            for id_key, route in list(self._by_id.items()):
                if id_key[0] in tenants or route.model_id in model_ids:
                    del self._by_id[id_key]
        return any(c.kind != ChangeKind.KEY for c in changes)

    def observe(self, observed: Observed, status: int) -> None:
        """A prediction was answered: count it, and offer it to the prediction log (which
        samples it, and never blocks)."""
        self.served_at = observed.started
        seconds = time.perf_counter() - observed.started
        if self.count_metrics:
            self.metrics.record(observed, status, seconds)
        route = observed.route
        if (
            self.log_predictions
            and route is not None
            and observed.names is not None
            and observed.arrays is not None
            and route.log_sample_rate > 0
        ):
            self.predlog.offer(
                route,
                arm=observed.arm,
                request_id=observed.trace.request_id,
                trace_id=observed.trace.trace_id,
                names=observed.names,
                arrays=observed.arrays,
                outputs=observed.outputs,
                latency_s=seconds,
                status=status,
            )

    # Background refresh ------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh_once()
                self.refreshed_at = time.monotonic()
            except Exception:  # a database blip must not stop the loop for good
                log.exception("gateway refresh failed; retrying")
            await asyncio.sleep(self.refresh_interval())

    def refresh_interval(self) -> float:
        """``SWITCHYARD_REFRESH_INTERVAL_S`` while this process serves predictions; at rest (none
        for ``REST_AFTER_S``) ``REST_INTERVAL_S``: the refresh's trip to the database was most
        of the web process's CPU at rest (bench/idle_bench.py), and at rest no cached answer is
        being used. A change still reaches a resting process within ``REST_INTERVAL_S``."""
        if time.perf_counter() - self.served_at < REST_AFTER_S:
            return self._interval
        return max(self._interval, REST_INTERVAL_S)

    def serving_ready(self) -> bool:
        """Whether this process can serve predictions now (``/v2/health/ready``): it has read
        the platform's configuration at least once, and either the database answered lately
        (new keys and routes can be looked up) or an agent link is ready (the cached ones are
        served while the database is away)."""
        if self.refreshed_at is None:
            return False
        fresh = time.monotonic() - self.refreshed_at < READY_STALE_S
        return fresh or self.pool.any_ready()

    async def refresh_once(self) -> None:
        self.metrics.fold()
        fold_dispatched(self.pool.dispatched)
        now = time.monotonic()
        layer = get_channel_layer()
        several = layer is not None and not isinstance(layer, InMemoryChannelLayer)
        # Taken before the read: a commit during it moves the stamp, and the next refresh reads.
        stamp = database_stamp()
        if stamp is None or stamp != self._stamp or now - self._read_at >= QUIET_READ_S:
            budgets_due = now - self._budgets_read >= settings.SWITCHYARD_BUDGET_REFRESH_S
            seen = self._generation
            # One trip to a database thread for everything the refresh reads.
            read = await db_call(read_shared)(seen, several, budgets_due)
            self._stamp, self._read_at = stamp, now
            if read.generation != seen:
                self._generation = read.generation
                if seen is not None and self.forget(read.changes):
                    for consumer in list(self.agent_consumers):
                        await consumer.push_assignment()
            if read.agents is not None:
                assert layer is not None
                await self._refresh_agents(layer, read.agents)
            if read.budget_stops is not None:
                self._budgets_read = now
                self.budget_stops = read.budget_stops
        if now - self._gateways_checked > gateways.SEEN_EVERY_S:
            self._gateways_checked = now
            await self._refresh_gateways()
        if now - self._last_flush > FLUSH_S:
            self._last_flush = now
            used, self._key_use = self._key_use, {}
            if used:
                await db_call(record_key_use)(used)
            counts = self.traffic.drain()
            if counts:
                await db_call(save_samples)(counts)
            shadows, self.shadow_stats = self.shadow_stats, {}
            if shadows:
                await db_call(record_shadow)(shadows)

    async def _refresh_agents(self, layer: BaseChannelLayer, agents: list[nodes.LiveAgent]) -> None:
        """Follow the agents alive in every process: the ready versions of the data links held
        here, and (the fallback) where to forward a request no link here can serve."""
        await self._follow_sessions(agents)
        local = self.pool.local_channel_names()
        remote: dict[int, list[str]] = {}
        for agent in agents:
            if agent.channel_name not in local:
                for vid in agent.ready:
                    remote.setdefault(vid, []).append(agent.channel_name)
        self.pool.set_remote(remote)
        self.pool.remote_spot = {a.channel_name for a in agents if a.spot}
        if remote and self._reply_task is None:
            await self._start_reply_listener(layer)

    async def _follow_sessions(self, agents: list[nodes.LiveAgent]) -> None:
        """A data link serves what its session has ready. While the agent's main connection
        moves (its process stopped: the session closed; or the agent attached a new session
        that has reported nothing ready yet) the link keeps serving what it served, for at
        most ``AGENT_STALE_S`` and only while its node stays enabled: the requests of the
        processes still up should not wait for the agent to say hello elsewhere."""
        links = self.pool.data_links()
        if not links:
            return
        by_session = {agent.session_id: agent for agent in agents}
        now = time.monotonic()
        carrying = []
        for link in links:
            agent = by_session.get(link.session or 0)
            if agent is not None:
                self.pool.set_spot(link, agent.spot)
            ready = (
                set(agent.ready) if agent is not None and agent.node_id == link.node_id else set()
            )
            if ready or (agent is not None and now >= link.carried_until):
                link.carried, link.carried_until = set(), 0.0
                self.pool.set_ready_versions(link, ready)
                continue
            if not link.carried_until:  # its session just closed: carry what it served
                carry(link, now)
            carrying.append(link)
        if carrying:
            enabled = await db_call(nodes.enabled_nodes)({link.node_id for link in carrying})
            for link in carrying:
                if now >= link.carried_until or link.node_id not in enabled:
                    link.carried = set()
                self.pool.set_ready_versions(link, link.carried)

    async def _refresh_gateways(self) -> None:
        """Mark this process seen, and tell the agents whose main connection is here when the
        other processes' link addresses change."""
        layer = get_channel_layer()
        if layer is None or isinstance(layer, InMemoryChannelLayer):
            return
        own = self.link_listener.key if self.link_listener is not None else ""
        if own:
            await db_call(gateways.mark_gateway_seen)(own)
        live = await db_call(gateways.live_gateways)()
        others = sorted(url for key, url in live.items() if key != own)
        if others != self.other_gateways:
            self.other_gateways = others
            for consumer in list(self.agent_consumers):
                await consumer.push_links()

    async def _start_reply_listener(self, layer: BaseChannelLayer) -> None:
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


async def lookup(fn: Callable[..., T], *args: Any) -> T:
    """A cache miss's database query. When the database does not answer in time (a lock held
    past ``SWITCHYARD_DB_LOCK_TIMEOUT_MS``, a stall, an outage) only this request fails, with
    503 and Retry-After; requests served from the caches never wait for it."""
    try:
        return await db_call(fn)(*args)
    except DatabaseError as exc:
        log.warning("a data-path lookup failed: %s", exc)
        raise DispatchError(
            503,
            "the platform's database did not answer in time; retry shortly",
            DB_RETRY_AFTER_S,
        ) from None


def carry(link: AgentLink, now: float) -> None:
    """Keep what a data link serves while its agent's main connection moves."""
    link.carried = set(link.ready)
    link.carried_until = now + settings.SWITCHYARD_AGENT_STALE_S


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


def all_states() -> list[GatewayState]:
    """Every event loop's gateway state in this process (shutdown flushes their logs)."""
    return list(_states.values())
