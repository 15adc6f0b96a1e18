"""Scheduling parameters at the gateway: OIP ``parameters.priority`` / ``parameters.timeout`` and
the ``x-switchyard-timeout-ms`` header, read by ``scheduling.schedule`` within the key's ceiling,
and carried on the infer frame to the agent. The agent side here is the real ``Serving`` and
``Batcher`` of ``serving_agent``, wired to the pool in process (the websocket hop is covered by
tests/e2e/test_fair_scheduling.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.layers import InMemoryChannelLayer
from channels.testing import HttpCommunicator

from gateway import scheduling
from gateway.consumers import AgentConsumer
from gateway.dispatch import AgentLink, AgentPool
from gateway.errors import ApiError
from gateway.oip import oip_app
from gateway.scheduling import Schedule
from gateway.state import GatewayState
from serving_agent import Batcher, FunctionRuntime
from serving_agent._serving import Serving
from serving_agent._versions import Loaded
from serving_agent.protocol import (
    BATCH,
    CRITICAL,
    INTERACTIVE,
    SHADOW,
    CancelGenerate,
    GenerateRequest,
    InferRequest,
    TensorSpec,
    VersionSpec,
    decode_frame,
    encode_frame,
    error_frame,
    tensor_of,
    unpack_frames,
)
from tenants.keys import KeyIdentity, create_api_key
from tenants.models import ApiKey
from tests.factories import make_model, make_version
from tests.onnx_models import small_onnx

SERVER_TIMEOUT_S = 10.0


def identity(priority: int = INTERACTIVE) -> KeyIdentity:
    return KeyIdentity(1, 7, "t", 10.0, 10, priority=priority)


def plan(params: object = None, header: str | None = None, key: int = INTERACTIVE) -> Schedule:
    state: Any = SimpleNamespace(infer_timeout=SERVER_TIMEOUT_S)
    return scheduling.schedule(state, identity(key), params, header)


# scheduling.schedule alone -------------------------------------------------------------------


def test_without_parameters_a_request_gets_its_keys_class_and_the_server_timeout() -> None:
    assert plan() == Schedule(INTERACTIVE, 10_000)
    assert plan({}, key=BATCH) == Schedule(BATCH, 10_000)


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        ("critical", CRITICAL),
        ("interactive", INTERACTIVE),
        ("batch", BATCH),
        ("shadow", SHADOW),
        (1, CRITICAL),  # Triton: 1 is the best level
        (2, INTERACTIVE),
        (3, BATCH),
        (4, SHADOW),
        (0, CRITICAL),  # Triton: 0 is the default, here the key's
    ],
)
def test_priority_is_a_class_name_or_tritons_integer(asked: object, expected: int) -> None:
    assert plan({"priority": asked}, key=CRITICAL).priority == expected


def test_a_timeout_in_microseconds_or_the_header_in_ms_shortens_the_budget() -> None:
    assert plan({"timeout": 250_000}).budget_ms == 250
    assert plan(header="40").budget_ms == 40
    assert plan(header=" 12.5 ").budget_ms == 12.5
    assert plan({"timeout": 250_000}, "40").budget_ms == 40  # the shorter of both


def test_a_timeout_longer_than_the_servers_is_capped_at_it() -> None:
    assert plan({"timeout": 3_600_000_000}, "999999").budget_ms == 10_000


@pytest.mark.parametrize(
    ("params", "header", "names"),
    [
        ({"priority": "urgent"}, None, "parameters.priority"),
        ({"priority": True}, None, "parameters.priority"),
        ({"priority": 5}, None, "parameters.priority"),
        ({"priority": -1}, None, "parameters.priority"),
        ({"priority": 1.0}, None, "parameters.priority"),
        ({"priority": {"class": "batch"}}, None, "parameters.priority"),
        ({"timeout": -1}, None, "parameters.timeout"),
        ({"timeout": 0}, None, "parameters.timeout"),
        ({"timeout": "100"}, None, "parameters.timeout"),
        ({"timeout": True}, None, "parameters.timeout"),
        ({"timeout": float("nan")}, None, "parameters.timeout"),
        ({"timeout": float("inf")}, None, "parameters.timeout"),
        ([1, 2], None, "parameters"),
        (None, "soon", "x-switchyard-timeout-ms"),
        (None, "-5", "x-switchyard-timeout-ms"),
        (None, "0", "x-switchyard-timeout-ms"),
        (None, "1e3", "x-switchyard-timeout-ms"),
        (None, "9" * 400, "x-switchyard-timeout-ms"),
    ],
)
def test_a_value_that_cannot_be_read_is_a_400_naming_the_field(
    params: object, header: str | None, names: str
) -> None:
    with pytest.raises(ApiError) as caught:
        plan(params, header)
    assert caught.value.status == 400
    assert caught.value.message.startswith(names + ":")
    assert len(caught.value.message) < 200  # a hostile value is not echoed in full


@pytest.mark.parametrize("asked", ["critical", 1, "interactive"])
def test_asking_above_the_keys_ceiling_is_a_403(asked: object) -> None:
    with pytest.raises(ApiError) as caught:
        plan({"priority": asked}, key=BATCH)
    assert caught.value.status == 403
    assert "above what this API key may ask for ('batch')" in caught.value.message


def test_the_frame_carries_caller_class_and_budget_and_decodes_back() -> None:
    x = np.ones((1, 4), np.float32)
    sent = InferRequest(
        id=3,
        version_id=9,
        inputs=[tensor_of("x", x)],
        tenant=42,
        key=5,
        priority=BATCH,
        budget_ms=250.5,
    )
    header, (y,) = decode_frame(encode_frame(sent, [x]))
    assert header == sent
    np.testing.assert_array_equal(y, x)
    plain, _ = decode_frame(encode_frame(InferRequest(id=4, version_id=9, inputs=[]), []))
    assert isinstance(plain, InferRequest)
    assert (plain.tenant, plain.key, plain.priority, plain.budget_ms) == (0, 0, INTERACTIVE, None)


# Through the OIP app to a real agent serving stack --------------------------------------------

pytestmark_db = pytest.mark.django_db(transaction=True)

BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0.1] * 4}]}


class InProcessAgent:
    """The agent's real ``Serving`` and ``Batcher`` behind a link in the pool: frames the
    gateway sends are served as the agent serves them; every header that arrives is kept."""

    def __init__(self, state: GatewayState, version_id: int) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.ran: list[int] = []
        self.headers: list[Any] = []

        def run(inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
            self.gate.wait(10)
            self.ran.append(len(inputs["x"]))
            return [inputs["x"][:, :2]]

        spec = VersionSpec(
            version_id=version_id,
            model="clf",
            version=1,
            sha256="0" * 64,
            artifact_url="",
            inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1, 4])],
            outputs=[TensorSpec(name="y", datatype="FP32", shape=[-1, 2])],
        )
        runtime = FunctionRuntime(run, ["x"], ["y"])
        self.loaded = Loaded(spec, runtime, Batcher(runtime, max_batch_size=1))
        self.serving = Serving({version_id: self.loaded}, self)
        self.pool = state.pool
        self.link = AgentLink("in-process", self.receive)
        self.pool.add(self.link)
        self.pool.set_ready(self.link, version_id, True)

    async def receive(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            self.headers.append(decode_frame(frame)[0])
            self.serving.handle_frame(frame)

    async def send_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.pool.deliver(self.link, frame)

    def stream_sender(self) -> Any:
        raise NotImplementedError


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> GatewayState:
    from gateway import oip

    gateway_state = GatewayState()
    monkeypatch.setattr(oip, "get_state", lambda: gateway_state)
    return gateway_state


@pytest.fixture
def agent(world: Any, state: GatewayState) -> InProcessAgent:
    """Tenant a's model "clf", served by an in-process agent."""
    version = make_version(make_model(world.a, "clf"), small_onnx())
    return InProcessAgent(state, version.pk)


def infer(
    key: str, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, dict[str, Any]]:
    response = async_to_sync(_post)(key, headers or [], body)
    return response["status"], json.loads(response["body"])


@pytestmark_db
def test_the_oip_request_reaches_the_agent_with_caller_class_and_budget(
    world: Any, agent: InProcessAgent
) -> None:
    body = {**BODY, "parameters": {"priority": "batch", "timeout": 2_000_000}}
    status, answer = infer(world.key_a, body, [(b"x-switchyard-timeout-ms", b"1500")])
    assert status == 200, answer
    (request,) = agent.headers
    assert (request.tenant, request.priority, request.budget_ms) == (world.a.pk, BATCH, 1500)
    assert request.key == ApiKey.objects.get(tenant=world.a).pk


@pytestmark_db
def test_hostile_parameters_are_a_400_in_the_oip_error_shape(
    world: Any, agent: InProcessAgent
) -> None:
    status, answer = infer(world.key_a, {**BODY, "parameters": {"priority": "asap"}})
    assert status == 400
    assert set(answer) == {"error"} and answer["error"].startswith("parameters.priority:")
    status, answer = infer(world.key_a, BODY, [(b"x-switchyard-timeout-ms", b"-1")])
    assert status == 400 and answer["error"].startswith("x-switchyard-timeout-ms:")
    assert agent.headers == []  # refused before anything was sent


@pytestmark_db
def test_a_key_asking_above_its_ceiling_is_a_403_and_its_default_travels(
    world: Any, agent: InProcessAgent
) -> None:
    _, batch_key = create_api_key(world.a, "nightly", priority=BATCH)
    status, answer = infer(batch_key, {**BODY, "parameters": {"priority": "critical"}})
    assert status == 403 and "'critical' is above" in answer["error"]
    status, _ = infer(batch_key, BODY)
    assert status == 200
    assert [h.priority for h in agent.headers] == [BATCH]


@pytestmark_db
def test_a_request_timed_out_at_the_gateway_is_cancelled_at_the_agent_and_never_runs(
    world: Any, agent: InProcessAgent
) -> None:
    agent.gate.clear()

    async def scenario() -> tuple[int, int]:
        # One request holds the model; the second waits in the queue past its 150 ms.
        first = asyncio.ensure_future(_post(world.key_a, []))
        await asyncio.sleep(0.2)
        second = await _post(world.key_a, [(b"x-switchyard-timeout-ms", b"150")])
        await asyncio.sleep(0.05)  # the cancel frame is sent after the 504
        agent.gate.set()
        return (await first)["status"], second["status"]

    first_status, second_status = async_to_sync(scenario)()
    assert (first_status, second_status) == (200, 504)
    assert isinstance(agent.headers[-1], CancelGenerate)
    assert agent.ran == [1]  # the cancelled request never reached the model
    counts = agent.loaded.batcher.counts
    assert counts.cancelled + counts.expired == 1


@pytestmark_db
def test_a_client_that_hangs_up_cancels_its_queued_request_at_the_agent(
    world: Any, agent: InProcessAgent
) -> None:
    agent.gate.clear()

    async def scenario() -> tuple[int, int]:
        first = asyncio.ensure_future(_post(world.key_a, []))
        await asyncio.sleep(0.2)  # the first request holds the model
        second = HttpCommunicator(
            oip_app,
            "POST",
            "/v2/models/clf/infer",
            body=json.dumps(BODY).encode(),
            headers=[(b"authorization", f"Bearer {world.key_a}".encode())],
        )
        await second.send_input({"type": "http.request", "body": second.body})
        await asyncio.sleep(0.3)  # queued behind the first, longer than the watch's delay
        await second.send_input({"type": "http.disconnect"})
        answer = await second.receive_output(timeout=5)
        await asyncio.sleep(0.05)  # the cancel frame is sent as the task unwinds
        agent.gate.set()
        return (await first)["status"], answer["status"]

    first_status, second_status = async_to_sync(scenario)()
    assert (first_status, second_status) == (200, 499)
    assert isinstance(agent.headers[-1], CancelGenerate)
    assert agent.ran == [1]  # the abandoned request never reached the model
    assert agent.loaded.batcher.counts.cancelled == 1


async def _post(
    key: str, headers: list[tuple[bytes, bytes]], body: dict[str, Any] = BODY
) -> dict[str, Any]:
    communicator = HttpCommunicator(
        oip_app,
        "POST",
        "/v2/models/clf/infer",
        body=json.dumps(body).encode(),
        headers=[(b"authorization", f"Bearer {key}".encode()), *headers],
    )
    return await communicator.get_response(timeout=10)


# A request forwarded from another gateway process: its cancel must not leak a reply route.


def test_a_forwarded_cancel_opens_no_reply_route_and_the_cancelled_answer_closes_one() -> None:
    async def scenario() -> tuple[list[bytes], dict[int, str], dict[int, str], bytes]:
        sent: list[bytes] = []

        async def to_agent(message: bytes) -> None:
            sent.extend(unpack_frames(message))

        consumer = AgentConsumer()
        consumer.remote_replies = {}
        consumer.channel_layer = InMemoryChannelLayer()
        consumer.state = SimpleNamespace(pool=AgentPool())
        consumer.link = AgentLink("agent", to_agent)
        consumer._send_message = to_agent  # type: ignore[method-assign]
        reply_channel = await consumer.channel_layer.new_channel()
        x = np.ones((1, 4), np.float32)
        infer_frame = encode_frame(
            InferRequest(id=7, version_id=1, inputs=[tensor_of("x", x)], budget_ms=50.0), [x]
        )
        await consumer.agent_forward({"frame": infer_frame, "reply": reply_channel})
        for request_id in (7, 9):  # the request's own cancel, and one for an unknown id
            cancel = encode_frame(CancelGenerate(id=request_id))
            await consumer.agent_forward({"frame": cancel, "reply": reply_channel})
        routes_while_queued = dict(consumer.remote_replies)
        await consumer._reply_frame(error_frame(7, "cancelled", "the caller gave up"))
        answered = await consumer.channel_layer.receive(reply_channel)
        return sent, routes_while_queued, consumer.remote_replies, answered["frame"]

    sent, routes_while_queued, routes_after, answered = async_to_sync(scenario)()
    assert [type(decode_frame(f)[0]).__name__ for f in sent] == [
        "InferRequest",
        "CancelGenerate",
        "CancelGenerate",
    ]
    assert list(routes_while_queued) == [7]
    assert routes_after == {}
    assert decode_frame(answered)[0].code == "cancelled"


# scheduling.generation_schedule: OpenAI's ``priority`` field and the socket's, or the header ----


def gen_plan(
    field: object = None,
    header: str | None = None,
    timeout: str | None = None,
    key: int = INTERACTIVE,
) -> Schedule:
    state: Any = SimpleNamespace(infer_timeout=SERVER_TIMEOUT_S)
    return scheduling.generation_schedule(state, identity(key), field, header, timeout)


def test_a_generation_takes_its_class_from_the_field_or_the_header() -> None:
    assert gen_plan() == Schedule(INTERACTIVE, 10_000)
    assert gen_plan(key=BATCH) == Schedule(BATCH, 10_000)  # the key's default
    assert gen_plan("batch").priority == BATCH
    assert gen_plan(4).priority == SHADOW  # Triton's integers, as OIP's parameter
    assert gen_plan(header=" shadow ").priority == SHADOW
    assert gen_plan("batch", "batch", "300") == Schedule(BATCH, 300)  # both, agreeing


@pytest.mark.parametrize(
    ("field", "header", "timeout", "names"),
    [
        ("urgent", None, None, "priority"),
        (True, None, None, "priority"),
        ({"class": "batch"}, None, None, "priority"),
        (None, "urgent", None, "x-switchyard-priority"),
        (None, "1", None, "x-switchyard-priority"),  # the header takes a class name only
        (None, "x" * 400, None, "x-switchyard-priority"),
        ("critical", "batch", None, "priority"),  # both, disagreeing
        (None, None, "soon", "x-switchyard-timeout-ms"),
    ],
)
def test_a_generations_unreadable_priority_is_a_400_naming_where_it_was(
    field: object, header: str | None, timeout: str | None, names: str
) -> None:
    with pytest.raises(ApiError) as caught:
        gen_plan(field, header, timeout)
    assert caught.value.status == 400
    assert caught.value.message.startswith(names + ":")
    assert len(caught.value.message) < 200


def test_a_generation_above_the_keys_ceiling_is_a_403_naming_where_it_was() -> None:
    with pytest.raises(ApiError) as caught:
        gen_plan("critical", key=BATCH)
    assert caught.value.status == 403 and caught.value.message.startswith("priority: 'critical'")
    with pytest.raises(ApiError) as caught:
        gen_plan(header="interactive", key=BATCH)
    assert caught.value.status == 403
    assert caught.value.message.startswith("x-switchyard-priority: 'interactive'")


def test_a_generate_frame_without_scheduling_fields_decodes_to_the_defaults() -> None:
    # An older gateway's frame: an agent reads it as interactive, without a deadline.
    old = msgspec.json.encode({"type": "generate", "id": 1, "version_id": 2, "prompt": "x"})
    frame = msgspec.json.decode(old, type=GenerateRequest)
    assert (frame.priority, frame.budget_ms) == (INTERACTIVE, None)
    sent = GenerateRequest(id=1, version_id=2, prompt="x", priority=SHADOW, budget_ms=12.5)
    assert decode_frame(encode_frame(sent))[0] == sent
