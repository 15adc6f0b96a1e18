"""The Redis channel layer, made to outlive a Redis outage.

Gateway processes reach agents held by other processes through the channel layer, but an
agent's own socket does not need it. channels_redis's ``receive`` raises when Redis is down,
and Channels lets that error end the consumer: every agent socket in the process dropped and
reconnected in a loop, and requests that only needed the local socket failed too. Here
``receive`` waits out the outage instead (no message can arrive while Redis is down, so waiting
is what a receive means), retrying with a growing pause. ``send`` still raises: its callers
turn that into an answer for the one request it concerned.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from channels_redis.core import RedisChannelLayer

from tenants.ratelimit import REDIS_ERRORS

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0


class FailSoftRedisChannelLayer(RedisChannelLayer):
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
