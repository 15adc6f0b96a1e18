"""The Redis channel layer, made to outlive a Redis outage.

Gateway processes reach agents held by other processes through the channel layer, but an
agent's own socket does not need it. channels_redis's ``receive`` raises when Redis is down,
and Channels lets that error end the consumer: every agent socket in the process dropped and
reconnected in a loop, and requests that only needed the local socket failed too. Here
``receive`` waits out the outage instead (no message can arrive while Redis is down, so waiting
is what a receive means), retrying with a growing pause. ``send`` still raises: its callers
turn that into an answer for the one request it concerned.

A ``send`` goes through the process's circuit of its Redis server (``tenants.ratelimit``,
shared with the rate limiter and the stream budgets), bounded by ``REDIS_TIMEOUT_S``: the
layer's connections have no socket timeout (a receive blocks on Redis), so a send to a stalled
Redis would otherwise wait for good, and an agent socket passing a reply on with it would stop
reading. While the circuit is open a send raises at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from channels_redis.core import RedisChannelLayer

from tenants.ratelimit import REDIS_ERRORS, RedisCircuit, redis_circuit

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0


class FailSoftRedisChannelLayer(RedisChannelLayer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.circuits: list[RedisCircuit] = [redis_circuit(_url(host)) for host in self.hosts]

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        # Every channel the platform sends to is a specific one (a consumer's, a reply
        # channel: "name!id"), which channels_redis keeps on the server its hash names.
        circuit = self.circuits[self.consistent_hash(channel)]
        await circuit.call(super().send, channel, message)

    async def receive(self, channel: str) -> dict[str, Any]:
        pause = RETRY_FIRST_S
        failed = False
        while True:
            try:
                message: dict[str, Any] = await super().receive(channel)
            except REDIS_ERRORS as exc:
                if not failed:
                    log.warning("channel layer: Redis is unreachable (%r); retrying", exc)
                failed = True
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            if failed:
                log.info("channel layer: Redis answers again")
            return message


def _url(host: dict[str, Any]) -> str:
    """The Redis URL of one of the layer's hosts (given as an address, or a host and port)."""
    return host.get("address") or f"redis://{host['host']}:{host['port']}"
