"""Data links: an agent's websocket to a gateway process other than the one holding its main
connection. A link attaches to a live session of its own node and serves exactly what that
session has ready; it claims nothing itself. While the agent's main connection moves, the link
keeps serving what it served (the requests of the processes still up should not fail), for a
bounded time and only while the node stays enabled."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from fleet import gateways
from fleet.models import AgentSession, GatewayProcess, Node
from fleet.nodes import create_node, live_agents
from gateway import consumers
from gateway.dispatch import AgentLink
from gateway.state import GatewayState
from serving_agent._links import DataLinks
from serving_agent._serving import Stats, result_frame
from serving_agent.protocol import (
    AGENT_WS_PATH,
    CLOSE_BAD_MESSAGE,
    CLOSE_CLAIM_REFUSED,
    Attach,
    Heartbeat,
    Hello,
    InferRequest,
    Links,
    VersionStatus,
    decode_frame,
    pack_frames,
    unpack_frames,
)
from tests.factories import make_model, make_tenant, make_version

pytestmark = pytest.mark.django_db(transaction=True)


def socket(token: str) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Bearer {token}".encode())]
    return WebsocketCommunicator(consumers.AgentConsumer.as_asgi(), AGENT_WS_PATH, headers=headers)


@pytest.fixture
def state(monkeypatch) -> GatewayState:
    gateway = GatewayState()
    monkeypatch.setattr(consumers, "get_state", lambda: gateway)
    return gateway


@pytest.fixture
def site(onnx_bytes):
    class Site:
        tenant = make_tenant("alpha")
        version = make_version(make_model(tenant), onnx_bytes)
        node, token = create_node("gpu-1")
        other, other_token = create_node("gpu-2")
        session = AgentSession.objects.create(
            node=node, channel_name="main-1", ready_versions=[version.pk]
        )

    return Site


def test_a_data_link_serves_its_sessions_ready_versions_in_process(site, state):
    async def run():
        link = socket(site.token)
        assert (await link.connect())[0]
        await link.send_to(text_data=Attach(session=site.session.pk).model_dump_json())
        await link.receive_nothing(timeout=0.2)
        served = state.pool.is_ready(site.version.pk)
        # A request in this process goes down the data link; the agent's reply answers it.
        x = np.ones((1, 4), np.float32)
        call = asyncio.ensure_future(state.pool.infer(site.version.pk, ["x"], [x], None, 5.0))
        (frame,) = unpack_frames((await link.receive_output(timeout=5))["bytes"])
        request, _ = decode_frame(frame)
        assert isinstance(request, InferRequest)
        await link.send_to(bytes_data=pack_frames([result_frame(request.id, ["y"], [x])]))
        reply, arrays = await call
        await link.disconnect()
        return served, arrays, state.pool.is_ready(site.version.pk)

    served, arrays, after = async_to_sync(run)()
    assert served and np.array_equal(arrays[0], np.ones((1, 4), np.float32))
    assert not after  # the link left the pool with its socket


def test_a_data_link_for_another_nodes_session_is_refused(site, state):
    async def run():
        rogue = socket(site.other_token)
        assert (await rogue.connect())[0]
        await rogue.send_to(text_data=Attach(session=site.session.pk).model_dump_json())
        return (await rogue.receive_output(timeout=5))["code"]

    assert async_to_sync(run)() == CLOSE_CLAIM_REFUSED
    assert not state.pool.is_ready(site.version.pk) and state.pool.data_links() == []


def test_a_closed_session_cannot_be_attached(site, state):
    AgentSession.objects.filter(pk=site.session.pk).update(disconnected_at="2026-01-01T00:00Z")

    async def run():
        link = socket(site.token)
        await link.connect()
        await link.send_to(text_data=Attach(session=site.session.pk).model_dump_json())
        return (await link.receive_output(timeout=5))["code"]

    assert async_to_sync(run)() == CLOSE_CLAIM_REFUSED


@pytest.mark.parametrize(
    "message",
    [
        VersionStatus(version_id=1, state="ready"),
        Heartbeat(),
        Hello(agent_version="x", host="h", cpu_count=1, memory_bytes=1),
    ],
    ids=["status", "heartbeat", "hello"],
)
def test_a_data_link_may_not_claim_report_or_say_hello(site, state, message):
    async def run():
        link = socket(site.token)
        await link.connect()
        await link.send_to(text_data=Attach(session=site.session.pk).model_dump_json())
        await link.send_to(text_data=message.model_dump_json())
        return (await link.receive_output(timeout=5))["code"]

    assert async_to_sync(run)() == CLOSE_BAD_MESSAGE
    assert not state.pool.is_ready(site.version.pk)


def test_a_main_connection_may_not_attach(site, state):
    async def run():
        main = socket(site.token)
        await main.connect()
        hello = Hello(agent_version="x", host="h", cpu_count=1, memory_bytes=1 << 30)
        await main.send_to(text_data=hello.model_dump_json())
        await main.receive_output(timeout=5)  # its assignment
        await main.send_to(text_data=Attach(session=site.session.pk).model_dump_json())
        return (await main.receive_output(timeout=5))["code"]

    assert async_to_sync(run)() == CLOSE_BAD_MESSAGE


def test_the_main_connection_learns_the_other_processes_and_its_session(site, state):
    state.other_gateways = ["ws://10.0.0.2:8100/ws/agent/"]

    async def run():
        main = socket(site.token)
        await main.connect()
        hello = Hello(agent_version="x", host="h", cpu_count=1, memory_bytes=1 << 30)
        await main.send_to(text_data=hello.model_dump_json())
        await main.receive_output(timeout=5)  # its assignment
        links = Links.model_validate(json.loads((await main.receive_output(timeout=5))["text"]))
        await main.disconnect()
        return links

    links = async_to_sync(run)()
    session = AgentSession.objects.get(node=site.node, channel_name__startswith="specific.")
    assert links.urls == state.other_gateways and links.session == session.pk


def follow(state: GatewayState) -> None:
    async_to_sync(state._follow_sessions)(live_agents())


def data_link(state: GatewayState, site, session: int) -> AgentLink:
    async def send(_: bytes) -> None:
        pass

    link = AgentLink("data", send, session=session, node_id=site.node.pk)
    state.pool.add(link)
    return link


def test_a_data_link_follows_its_session_and_carries_over_while_it_moves(site, state, settings):
    settings.SWITCHYARD_AGENT_STALE_S = 30
    link = data_link(state, site, site.session.pk)
    follow(state)
    assert link.ready == {site.version.pk}
    # The main connection's process stopped: the session closed; the link keeps serving.
    AgentSession.objects.filter(pk=site.session.pk).update(disconnected_at="2026-01-01T00:00Z")
    follow(state)
    assert state.pool.is_ready(site.version.pk)
    # The agent said hello elsewhere and re-attached the new session; nothing ready there yet.
    new = AgentSession.objects.create(node=site.node, channel_name="main-2")
    link.session = new.pk
    follow(state)
    assert state.pool.is_ready(site.version.pk)
    # Its first ready version ends the carry-over: the new session's word counts from now on.
    AgentSession.objects.filter(pk=new.pk).update(ready_versions=[])
    AgentSession.objects.filter(pk=new.pk).update(ready_versions=[site.version.pk + 1000])
    follow(state)
    assert link.ready == {site.version.pk + 1000} and not link.carried


def test_the_carry_over_ends_after_the_stale_time_or_when_the_node_is_disabled(
    site, state, settings
):
    settings.SWITCHYARD_AGENT_STALE_S = 30
    link = data_link(state, site, site.session.pk)
    follow(state)
    AgentSession.objects.filter(pk=site.session.pk).update(disconnected_at="2026-01-01T00:00Z")
    follow(state)
    link.carried_until = time.monotonic() - 1  # as if AGENT_STALE_S had passed
    follow(state)
    assert not state.pool.is_ready(site.version.pk)

    other = data_link(state, site, site.session.pk)
    state.pool.set_ready_versions(other, {site.version.pk})
    follow(state)
    assert state.pool.is_ready(site.version.pk)  # carried...
    Node.objects.filter(pk=site.node.pk).update(enabled=False)
    follow(state)
    assert not state.pool.is_ready(site.version.pk)  # ...until the node is disabled


def test_gateway_processes_register_expire_and_deregister():
    gateways.register_gateway("a" * 32, "ws://127.0.0.1:1/ws/agent/", "h:1")
    gateways.register_gateway("b" * 32, "ws://127.0.0.1:2/ws/agent/", "h:2")
    assert set(gateways.live_gateways()) == {"a" * 32, "b" * 32}
    GatewayProcess.objects.filter(key="b" * 32).update(seen_at="2026-01-01T00:00Z")
    assert set(gateways.live_gateways()) == {"a" * 32}
    gateways.mark_gateway_seen("b" * 32)
    gateways.deregister_gateway("a" * 32)
    assert set(gateways.live_gateways()) == {"b" * 32}


def test_the_agent_keeps_one_link_per_listed_address_and_reattaches_a_new_session():
    async def run():
        links = DataLinks("ws://platform/ws/agent/", {}, {}, Stats(), retry_base=30)
        first = ["ws://127.0.0.1:9/ws/agent/", "ws://127.0.0.1:10/ws/agent/"]
        links.update(Links(session=1, urls=first))
        opened = dict(links.links)
        links.update(Links(session=2, urls=first[1:]))
        await asyncio.sleep(0)
        kept = links.links[first[1]]
        result = (set(opened), set(links.links), kept is opened[first[1]], kept.session)
        await links.close()
        return result

    opened, kept, same, session = async_to_sync(run)()
    assert len(opened) == 2 and len(kept) == 1 and same and session == 2


def test_the_agent_never_sends_its_token_in_clear_when_its_main_connection_is_not():
    async def run():
        links = DataLinks("wss://platform/ws/agent/", {}, {}, Stats(), retry_base=30)
        urls = ["ws://10.0.0.2:8100/ws/agent/", "wss://10.0.0.3:8100/ws/agent/"]
        links.update(Links(session=1, urls=urls))
        result = set(links.links)
        await links.close()
        return result

    assert async_to_sync(run)() == {"wss://10.0.0.3:8100/ws/agent/"}


def test_a_links_message_is_checked_on_arrival():
    with pytest.raises(ValueError):
        Links.model_validate({"type": "links", "session": 1, "urls": ["http://x/"]})
    with pytest.raises(ValueError):
        Links.model_validate({"type": "links", "session": 1, "urls": ["ws://" + "x" * 400]})
    with pytest.raises(ValueError):
        Links.model_validate({"type": "links", "session": 1, "urls": ["ws://x/"] * 300})


@pytest.mark.django_db(transaction=False)
@pytest.mark.parametrize(
    ("restarting", "status", "retry_after"), [(False, 502, None), (True, 503, 1)]
)
def test_requests_in_flight_on_a_lost_link_fail_by_who_closed_it(restarting, status, retry_after):
    """The agent gone: 502, its work is lost. This server shutting down (it closed the socket
    itself, code 1012): 503 with Retry-After, as the agent still serves through other
    processes."""
    from gateway.dispatch import AgentPool, DispatchError

    async def scenario() -> DispatchError:
        async def send(message: bytes) -> None:
            pass

        pool = AgentPool()
        link = AgentLink("agent", send)
        pool.add(link)
        pool.set_ready(link, 7, True)
        waiting = asyncio.create_task(pool.infer(7, ["x"], [np.ones((1, 4), "f4")], None, 5.0))
        await asyncio.sleep(0.01)
        assert link.pending
        pool.remove(link, "gone", restarting=restarting)
        with pytest.raises(DispatchError) as caught:
            await waiting
        return caught.value

    error = asyncio.run(scenario())
    assert (error.status, error.retry_after) == (status, retry_after)


@pytest.mark.django_db(transaction=False)
@pytest.mark.parametrize(
    ("restarting", "status", "retry_after"), [(None, 502, None), (False, 502, None), (True, 503, 1)]
)
def test_a_send_that_fails_as_the_socket_closes_answers_by_how_it_closed(
    restarting, status, retry_after
):
    """A send fails the moment the socket closes, a moment before the server reports why: a
    request whose send failed waits for that, so a shutdown of this process answers the
    retryable 503 its in-flight requests get (None: the end is never reported, 502)."""
    from gateway.dispatch import AgentPool, DispatchError

    async def scenario() -> DispatchError:
        pool = AgentPool()

        async def send(message: bytes) -> None:
            if restarting is not None:
                loop.call_later(0.01, lambda: pool.remove(link, "gone", restarting=restarting))
            raise ConnectionError("closed")

        loop = asyncio.get_running_loop()
        link = AgentLink("agent", send)
        pool.add(link)
        pool.set_ready(link, 7, True)
        with pytest.raises(DispatchError) as caught:
            await pool.infer(7, ["x"], [np.ones((1, 4), "f4")], None, 5.0)
        return caught.value

    error = asyncio.run(scenario())
    assert (error.status, error.retry_after) == (status, retry_after)


def test_a_socket_closed_by_the_servers_shutdown_fails_its_requests_as_retryable(site, state):
    async def scenario() -> tuple[int, int | None]:
        ws = socket(site.token)
        await ws.connect()
        hello = Hello(agent_version="x", host="h", cpu_count=1, memory_bytes=1 << 30)
        await ws.send_to(text_data=hello.model_dump_json())
        await ws.receive_output(timeout=5)  # its assignment
        state.pool.set_ready(state.pool._links[0], site.version.pk, True)
        waiting = asyncio.create_task(
            state.pool.infer(site.version.pk, ["x"], [np.ones((1, 4), "f4")], None, 5.0)
        )
        await asyncio.sleep(0.05)
        await ws.disconnect(code=consumers.SERVER_RESTART)
        try:
            await waiting
        except DispatchError as exc:
            return exc.status, exc.retry_after
        raise AssertionError("the request did not fail")

    from gateway.dispatch import DispatchError

    assert async_to_sync(scenario)() == (503, 1)
