"""The web UI's live socket: a signed-in user subscribes to the dashboard or to one rollout plan
and gets a snapshot at once and then every 2 s, so pages update without reloading.

Client → server: ``{"subscribe": "dashboard"}`` or ``{"subscribe": "plan", "id": 7}``.
Server → client: ``{"type": "dashboard", ...}`` or ``{"type": "plan", ...}`` (``web.snapshots``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from rollouts.access import plans_of
from tenants.members import current_membership

from .snapshots import dashboard_snapshot, plan_snapshot

log = logging.getLogger(__name__)

INTERVAL_S = 2.0
CLOSE_BAD_MESSAGE = 4400
CLOSE_NO_TENANT = 4403
CLOSE_NOT_FOUND = 4404


def plan_update(tenant_id: int, plan_id: int) -> dict[str, Any] | None:
    plan = plans_of(tenant_id).filter(pk=plan_id).first()  # afresh: state and weight move
    return None if plan is None else {"type": "plan"} | plan_snapshot(plan)


def dashboard_update(tenant_id: int) -> dict[str, Any]:
    return {"type": "dashboard"} | dashboard_snapshot(tenant_id)


class LiveConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        self.pusher: asyncio.Task[None] | None = None
        self.tenant_id: int | None = None
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()  # refused during the handshake: the browser sees a failed socket
            return
        membership = await database_sync_to_async(current_membership)(user, self.scope["session"])
        await self.accept()
        if membership is None:
            await self.close(code=CLOSE_NO_TENANT)
            return
        self.tenant_id = membership.tenant_id

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        # Malformed JSON is a bad message (close 4400), not a crash with a traceback.
        try:
            content = json.loads(text_data) if text_data else None
        except ValueError:
            content = None
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("subscribe") if isinstance(content, dict) else None
        if self.tenant_id is None:
            return
        build: Callable[[], dict[str, Any] | None]
        if kind == "dashboard":
            build = partial(dashboard_update, self.tenant_id)
        elif kind == "plan" and isinstance(content.get("id"), int):
            build = partial(plan_update, self.tenant_id, content["id"])
        else:
            await self.close(code=CLOSE_BAD_MESSAGE)
            return
        self._stop()  # one subscription per socket: a new one replaces the old
        first = await database_sync_to_async(build)()
        if first is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        await self.send_json(first)
        self.pusher = asyncio.create_task(self._push(build))

    async def _push(self, build: Callable[[], dict[str, Any] | None]) -> None:
        try:
            while True:
                await asyncio.sleep(INTERVAL_S)
                update = await database_sync_to_async(build)()
                if update is None:  # the plan went away (its model was deleted)
                    await self.close(code=CLOSE_NOT_FOUND)
                    return
                await self.send_json(update)
        except Exception:
            log.exception("live updates stopped")
            await self.close(code=1011)

    async def disconnect(self, code: int) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.pusher is not None:
            self.pusher.cancel()
            self.pusher = None
