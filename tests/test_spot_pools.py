"""Spot pools: ``Pool.spot`` set through the admin, ``sync_pools`` (the Helm chart's gpuPools)
and shown by the API and the fleet page, audited; a link carries its pool's flag from the hello
or attach, and dispatch sends batch-class requests to spot links and everything else to the
others, falling back to any ready link; a link that dies answers its requests with a retryable
502."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from fleet.models import AgentSession, Deployment, Pool
from fleet.nodes import create_node, live_agents, session_spot
from gateway import consumers
from gateway.dispatch import AgentLink, AgentPool, DispatchError, prefer_spot
from gateway.state import GatewayState
from serving_agent._serving import result_frame
from serving_agent.protocol import (
    AGENT_WS_PATH,
    BATCH,
    CRITICAL,
    INTERACTIVE,
    SHADOW,
    Attach,
    Hello,
    InferRequest,
    decode_frame,
    pack_frames,
    unpack_frames,
)
from tenants.models import AuditEvent
from tests.factories import as_user, make_model, make_session, make_tenant, make_version

X = np.ones((1, 4), np.float32)


# The flag where pools are set ----------------------------------------------------------------


@pytest.mark.django_db
def test_sync_pools_sets_and_changes_the_spot_flag_audited() -> None:
    from io import StringIO

    from django.core.management import call_command

    def sync(data: list[dict]) -> str:
        out = StringIO()
        call_command("sync_pools", "--json", json.dumps(data), stdout=out)
        return out.getvalue()

    assert "created: gpu-spot" in sync([{"name": "gpu-spot", "backend": "local", "spot": True}])
    assert Pool.objects.get(name="gpu-spot").spot
    created = AuditEvent.objects.get(action="pool.create")
    assert created.after["spot"] is True
    assert "updated: gpu-spot" in sync([{"name": "gpu-spot", "backend": "local", "spot": False}])
    assert not Pool.objects.get(name="gpu-spot").spot
    update = AuditEvent.objects.get(action="pool.update")
    assert (update.before, update.after) == ({"spot": True}, {"spot": False})
    # Omitted means on-demand capacity, the default.
    sync([{"name": "plain", "backend": "local"}])
    assert not Pool.objects.get(name="plain").spot


@pytest.mark.django_db
def test_sync_pools_refuses_a_spot_flag_that_is_not_a_boolean() -> None:
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match=r"pools\[0\]\.spot: expected true or false"):
        call_command("sync_pools", "--json", '[{"name": "a", "backend": "local", "spot": "yes"}]')
    assert not Pool.objects.exists()


def test_the_helm_chart_renders_spot_into_the_pools_file() -> None:
    from tests.test_sync_pools import _chart_pools

    text = _chart_pools(
        "gpuPools[0].name=gpu-a100",
        "gpuPools[1].name=gpu-t4-spot",
        "gpuPools[1].spot=true",
    )
    assert [(p["name"], p["spot"]) for p in json.loads(text)] == [
        ("gpu-a100", False),
        ("gpu-t4-spot", True),
    ]


@pytest.mark.django_db
def test_the_admin_sets_the_flag_audited_and_the_api_and_fleet_page_show_it(
    client, django_user_model, world, onnx_bytes
) -> None:
    admin = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin)
    response = client.post(
        "/admin/fleet/pool/add/",
        {
            "name": "gpu-spot",
            "backend": "local",
            "namespace": "switchyard",
            "node_selector": "{}",
            "tolerations": "[]",
            "spot": "on",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    pool = Pool.objects.get(name="gpu-spot")
    assert pool.spot
    event = AuditEvent.objects.get(action="pool.create", target__contains="gpu-spot")
    assert event.after["spot"] is True
    assert "spot" in client.get("/admin/fleet/pool/").content.decode()

    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {world.key_a}")
    listed = api.get("/api/v1/pools").json()
    assert [(p["name"], p["spot"]) for p in listed] == [("gpu-spot", True)]

    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    Deployment.objects.create(tenant=world.a, version=version, pool=pool)

    page = as_user(world.viewer_a).get("/fleet/")
    assert page.status_code == 200
    assert ">spot</span>" in page.content.decode()


# The flag on the links -----------------------------------------------------------------------


@pytest.mark.django_db
def test_sessions_report_their_pools_flag(onnx_bytes) -> None:
    tenant = make_tenant("alpha")
    version = make_version(make_model(tenant), onnx_bytes)
    spot = Pool.objects.create(name="spot", backend="local", spot=True)
    plain = Pool.objects.create(name="plain", backend="local")
    on_spot = Deployment.objects.create(tenant=tenant, version=version, pool=spot)
    on_plain = Deployment.objects.create(tenant=tenant, version=version, pool=plain)
    node, _ = create_node("n1")
    a = make_session(node, on_spot.cluster_name)
    b = make_session(node, on_plain.cluster_name)
    c = make_session(node)  # a node run by hand belongs to no pool
    assert (session_spot(a.pk), session_spot(b.pk), session_spot(c.pk)) == (True, False, False)
    assert {x.session_id: x.spot for x in live_agents()} == {a.pk: True, b.pk: False, c.pk: False}


@pytest.fixture
def spot_site(onnx_bytes, monkeypatch, transactional_db):
    """A gateway state of the test's own, a version deployed on a spot pool, and a node."""

    class Site:
        state = GatewayState()
        tenant = make_tenant("alpha")
        version = make_version(make_model(tenant), onnx_bytes)
        pool = Pool.objects.create(name="spot", backend="local", spot=True)
        deployment = Deployment.objects.create(tenant=tenant, version=version, pool=pool)
        node, token = create_node("spot-1")

    monkeypatch.setattr(consumers, "get_state", lambda: Site.state)
    return Site


def agent_socket(token: str) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Bearer {token}".encode())]
    return WebsocketCommunicator(consumers.AgentConsumer.as_asgi(), AGENT_WS_PATH, headers)


def mark_on_demand(pool: Pool) -> None:
    Pool.objects.filter(pk=pool.pk).update(spot=False)


def test_a_replica_on_a_spot_pool_says_hello_and_its_link_is_spot(spot_site):
    site = spot_site

    async def run() -> tuple[bool, bool]:
        ws = agent_socket(site.token)
        assert (await ws.connect())[0]
        hello = Hello(
            agent_version="test",
            host="h",
            cpu_count=1,
            memory_bytes=1 << 30,
            deployment=site.deployment.cluster_name,
        )
        await ws.send_to(text_data=hello.model_dump_json())
        await ws.receive_from(timeout=5)  # the assignment
        (consumer,) = site.state.agent_consumers
        first = consumer.link.spot
        # The pool is marked on-demand: the next assignment push carries the change.
        await asyncio.to_thread(mark_on_demand, site.pool)
        await consumer.push_assignment()
        second = consumer.link.spot
        await ws.disconnect()
        return first, second

    assert async_to_sync(run)() == (True, False)
    assert AgentSession.objects.get().deployment_id == site.deployment.pk


def test_a_data_link_carries_its_sessions_flag_and_follows_it(spot_site):
    site = spot_site
    session = make_session(site.node, site.deployment.cluster_name, channel="main-elsewhere")
    AgentSession.objects.filter(pk=session.pk).update(ready_versions=[site.version.pk])

    async def run() -> tuple[bool, bool]:
        ws = agent_socket(site.token)
        assert (await ws.connect())[0]
        await ws.send_to(text_data=Attach(session=session.pk).model_dump_json())
        await ws.receive_nothing(timeout=0.2)
        (data_link,) = site.state.pool.data_links()
        attached = data_link.spot
        # The refresh loop follows the session's pool: marked on-demand, the link follows.
        await asyncio.to_thread(mark_on_demand, site.pool)
        await site.state._follow_sessions(await asyncio.to_thread(live_agents))
        followed = data_link.spot
        await ws.disconnect()
        return attached, followed

    assert async_to_sync(run)() == (True, False)


# Dispatch ------------------------------------------------------------------------------------


def link(name: str, spot: bool) -> AgentLink:
    return AgentLink(name, _never, ready={1}, spot=spot)


async def _never(message: bytes) -> None:
    raise AssertionError("not sent in this test")


SPOT, PLAIN, PLAIN2 = link("spot", True), link("plain", False), link("plain2", False)

PREFERENCES = [
    # (links, priority, the links the request chooses among)
    ([SPOT, PLAIN], BATCH, [SPOT]),
    ([SPOT, PLAIN], INTERACTIVE, [PLAIN]),
    ([SPOT, PLAIN], CRITICAL, [PLAIN]),
    ([SPOT, PLAIN], SHADOW, [PLAIN]),
    ([SPOT, PLAIN, PLAIN2], INTERACTIVE, [PLAIN, PLAIN2]),
    ([PLAIN, PLAIN2], BATCH, [PLAIN, PLAIN2]),  # no spot capacity: any ready link
    ([SPOT], INTERACTIVE, [SPOT]),  # only spot capacity: it serves everyone
    ([], BATCH, []),
]


@pytest.mark.parametrize(("links", "priority", "chosen"), PREFERENCES)
def test_prefer_spot(links: list[AgentLink], priority: int, chosen: list[AgentLink]) -> None:
    assert prefer_spot(links, priority) == chosen


class Agent:
    """A link whose agent answers every request at once, counting what it served."""

    def __init__(self, pool: AgentPool, name: str, spot: bool) -> None:
        self.pool = pool
        self.served = 0
        self.link = AgentLink(name, self.receive, spot=spot)
        pool.add(self.link)
        pool.set_ready(self.link, 1, True)

    async def receive(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            request, _ = decode_frame(frame)
            if isinstance(request, InferRequest):
                self.served += 1
                reply = pack_frames([result_frame(request.id, ["y"], [X])])
                asyncio.get_running_loop().call_soon(self._deliver, reply)

    def _deliver(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            self.pool.deliver(self.link, frame)


def test_dispatch_sends_batch_to_spot_and_the_rest_to_on_demand_agents() -> None:
    async def run() -> tuple[int, int, int, int]:
        pool = AgentPool()
        spot, plain = Agent(pool, "spot", True), Agent(pool, "plain", False)
        await asyncio.gather(
            *(pool.infer(1, ["x"], [X], None, 5.0, priority=BATCH) for _ in range(20))
        )
        batch = (spot.served, plain.served)
        await asyncio.gather(
            *(pool.infer(1, ["x"], [X], None, 5.0, priority=INTERACTIVE) for _ in range(20))
        )
        return batch[0], batch[1], spot.served - batch[0], plain.served - batch[1]

    assert async_to_sync(run)() == (20, 0, 0, 20)


def test_without_spot_capacity_batch_is_served_by_any_ready_agent() -> None:
    async def run() -> int:
        pool = AgentPool()
        plain = Agent(pool, "plain", False)
        for _ in range(5):
            await pool.infer(1, ["x"], [X], None, 5.0, priority=BATCH)
        return plain.served

    assert async_to_sync(run)() == 5


def test_a_pre_empted_spot_agent_answers_its_requests_with_a_retryable_502() -> None:
    async def run() -> DispatchError:
        pool = AgentPool()
        sent = asyncio.Event()

        async def swallow(message: bytes) -> None:
            sent.set()  # taken, never answered: the node is pre-empted under it

        spot = AgentLink("spot", swallow, spot=True)
        pool.add(spot)
        pool.set_ready(spot, 1, True)
        call = asyncio.ensure_future(pool.infer(1, ["x"], [X], None, 5.0, priority=BATCH))
        await sent.wait()
        pool.remove(spot, "the serving agent disconnected during the request")
        try:
            await call
        except DispatchError as exc:
            return exc
        raise AssertionError("answered")

    error = async_to_sync(run)()
    assert (error.status, error.retry_after) == (502, 1)


def test_a_forwarded_request_prefers_the_same_kind_of_agent() -> None:
    """The channel-layer fallback (an agent with no link to this process yet) chooses alike."""
    pool = AgentPool()
    pool.remote_spot = {"spot-channel"}
    both = ["spot-channel", "plain-channel"]
    assert pool._remote_choice(both, BATCH) == ["spot-channel"]
    assert pool._remote_choice(both, INTERACTIVE) == ["plain-channel"]
    assert pool._remote_choice(["plain-channel"], BATCH) == ["plain-channel"]
    assert pool._remote_choice(["spot-channel"], CRITICAL) == ["spot-channel"]
