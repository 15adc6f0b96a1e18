"""Agents are untrusted: the gateway routes an agent only the versions its connection is
assigned now. A state of a version it was never assigned (another tenant's, or a forgery), or a
replica naming another tenant's deployment, closes the socket with CLOSE_CLAIM_REFUSED; an
assignment change takes back what was allowed; placement ignores memory figures for versions
an agent was not accepted for."""

from __future__ import annotations

import json

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from fleet.assignments import measured_needs
from fleet.models import AgentSession, Deployment, Pool
from fleet.nodes import create_node, record_heartbeat
from gateway import consumers
from gateway.dispatch import DispatchError
from gateway.state import GatewayState
from registry.services import set_alias
from serving_agent.protocol import (
    AGENT_WS_PATH,
    CLOSE_CLAIM_REFUSED,
    Assign,
    Hello,
    VersionStatus,
)
from tests.factories import make_model, make_tenant, make_version

pytestmark = pytest.mark.django_db(transaction=True)


class ScriptedAgent:
    """An agent that says what the test tells it to, over the real consumer."""

    def __init__(self, token: str) -> None:
        headers = [(b"authorization", f"Bearer {token}".encode())]
        self.socket = WebsocketCommunicator(
            consumers.AgentConsumer.as_asgi(), AGENT_WS_PATH, headers=headers
        )

    async def hello(self, deployment: str | None = None) -> Assign | int:
        """Connect and say hello: the assignment it is sent, or the close code."""
        connected, _ = await self.socket.connect()
        assert connected
        hello = Hello(
            agent_version="rogue", host="h", cpu_count=1, memory_bytes=1 << 30,
            deployment=deployment,
        )  # fmt: skip
        await self.socket.send_to(text_data=hello.model_dump_json())
        return await self.next()

    async def say(self, version_id: int, state: str = "ready") -> None:
        status = VersionStatus(version_id=version_id, state=state)
        await self.socket.send_to(text_data=status.model_dump_json())

    async def next(self) -> Assign | int:
        """The next assignment sent to the agent, or the code the socket was closed with."""
        output = await self.socket.receive_output(timeout=10)
        if output["type"] == "websocket.close":
            return output["code"]
        return Assign.model_validate(json.loads(output["text"]))


@pytest.fixture
def state(monkeypatch) -> GatewayState:
    """This test's gateway process state, without its refresh loop."""
    gateway = GatewayState()
    monkeypatch.setattr(consumers, "get_state", lambda: gateway)
    return gateway


@pytest.fixture
def site(onnx_bytes):
    class Site:
        a, b = make_tenant("alpha"), make_tenant("beta")
        model_a = make_model(a)
        version_a = make_version(model_a, onnx_bytes)
        _, beta_token = create_node("beta-gpu", b)  # serves tenant beta only
        _, shared_token = create_node("shared-gpu")  # serves every tenant

    return Site


async def no_agent_serves(state: GatewayState, version_id: int) -> bool:
    try:
        await state.pool.infer(version_id, ["x"], [np.zeros((1, 4), np.float32)], None, 1.0)
    except DispatchError as exc:
        return exc.status == 503
    return False


def test_another_tenants_node_claiming_a_version_gets_no_request_and_is_closed(site, state):
    async def run():
        rogue = ScriptedAgent(site.beta_token)
        assignment = await rogue.hello()
        assert isinstance(assignment, Assign) and assignment.versions == []
        await rogue.say(site.version_a.pk, "ready")
        closed = await rogue.next()
        unserved = await no_agent_serves(state, site.version_a.pk)
        return closed, unserved

    closed, unserved = async_to_sync(run)()
    assert closed == CLOSE_CLAIM_REFUSED
    assert unserved and not state.pool.is_ready(site.version_a.pk)
    session = AgentSession.objects.get(node__name="beta-gpu")
    assert session.ready_versions == [] and session.disconnected_at is not None


def test_a_state_of_a_version_never_assigned_closes_the_socket_whatever_it_says(site, state):
    async def run():
        rogue = ScriptedAgent(site.beta_token)
        await rogue.hello()
        await rogue.say(site.version_a.pk, "loading")
        return await rogue.next()

    assert async_to_sync(run)() == CLOSE_CLAIM_REFUSED
    assert AgentSession.objects.get(node__name="beta-gpu").version_states == {}


def test_an_agent_is_routed_what_it_was_assigned_and_an_assignment_change_takes_it_back(
    site, state, onnx_bytes
):
    async def ready_then_moved():
        agent = ScriptedAgent(site.shared_token)
        assignment = await agent.hello()
        assert [v.version_id for v in assignment.versions] == [site.version_a.pk]
        await agent.say(site.version_a.pk, "ready")
        await agent.socket.receive_nothing(timeout=0.2)  # the status is handled
        routed = state.pool.is_ready(site.version_a.pk)
        # production moves to a new version: the old one leaves the assignment.
        await moved()
        for consumer in list(state.agent_consumers):
            await consumer.push_assignment()
        reassigned = await agent.next()
        revoked = not state.pool.is_ready(site.version_a.pk)
        # A late "ready" of the version it no longer has is recorded, not routed, not refused.
        await agent.say(site.version_a.pk, "ready")
        await agent.socket.receive_nothing(timeout=0.2)
        still_revoked = not state.pool.is_ready(site.version_a.pk)
        await agent.socket.disconnect()
        return routed, reassigned, revoked, still_revoked

    from channels.db import database_sync_to_async

    @database_sync_to_async
    def moved():
        # Kept warm for no time after it leaves the alias (the last-known-good window).
        site.model_a.rollback_warm_s = 0
        site.model_a.save(update_fields=["rollback_warm_s"])
        set_alias(site.model_a, "production", make_version(site.model_a, onnx_bytes, alias=None))

    routed, reassigned, revoked, still_revoked = async_to_sync(ready_then_moved)()
    assert routed
    assert isinstance(reassigned, Assign)
    assert site.version_a.pk not in [v.version_id for v in reassigned.versions]
    assert revoked and still_revoked
    # Other gateway processes route by the session row: it no longer lists the version.
    assert AgentSession.objects.get(node__name="shared-gpu").ready_versions == []


def test_a_replica_naming_another_tenants_deployment_is_refused(site, state):
    pool = Pool.objects.create(name="local", backend="local")
    deployment = Deployment.objects.create(tenant=site.a, version=site.version_a, pool=pool)

    async def run():
        return await ScriptedAgent(site.beta_token).hello(deployment=deployment.cluster_name)

    assert async_to_sync(run)() == CLOSE_CLAIM_REFUSED
    assert not AgentSession.objects.filter(deployment=deployment).exists()


def test_placement_counts_memory_only_for_versions_an_agent_was_accepted_for(site, state):
    async def run():
        rogue = ScriptedAgent(site.beta_token)
        await rogue.hello()
        return rogue

    async_to_sync(run)()
    session = AgentSession.objects.get(node__name="beta-gpu")
    inflated = {"versions": [{"version_id": site.version_a.pk, "memory_bytes": 1 << 40}]}
    record_heartbeat(session.pk, session.node_id, inflated)
    assert site.version_a.pk not in measured_needs()
