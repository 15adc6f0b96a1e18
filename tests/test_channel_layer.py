"""The gateway's channel layer waits out a Redis outage instead of ending the consumer."""

import asyncio

from gateway.channel_layer import FailSoftRedisChannelLayer
from tenants.ratelimit import REDIS_ERRORS


def test_a_receive_waiting_through_a_redis_restart_gets_the_next_message(own_redis):
    async def run():
        layer = FailSoftRedisChannelLayer(hosts=[{"address": own_redis.url}])
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "before"})
        first = await layer.receive(channel)
        waiting = asyncio.ensure_future(layer.receive(channel))
        await asyncio.sleep(0.2)
        own_redis.stop()
        await asyncio.sleep(1.0)
        # The plain layer's receive would have raised by now, ending the consumer.
        assert not waiting.done()
        own_redis.start()
        for _ in range(50):  # the layer's own connections reconnect; a send may need a retry
            try:
                await layer.send(channel, {"type": "after"})
                break
            except REDIS_ERRORS:
                await asyncio.sleep(0.1)
        second = await asyncio.wait_for(waiting, 15)
        await layer.flush()
        await layer.close_pools()
        return first, second

    first, second = asyncio.run(run())
    assert first["type"] == "before" and second["type"] == "after"
