"""OpenTelemetry spans (docs/observability.md, "Traces"), sent to a real OTLP receiver this
test starts (gRPC and HTTP): the whole tree of one request through the real ASGI application
and the agent's real ``Serving`` (in process, back to back), a graph's node spans, sampling
and its flags, hostile traceparents, a Celery task's span. With real processes:
``tests/e2e/test_otel_e2e.py``."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import onnxruntime as ort
import pytest
from asgiref.sync import async_to_sync
from celery import Celery
from channels.testing import HttpCommunicator

from gateway import generate_ws, oip, openai_api, spans, tracing
from gateway import state as state_module
from gateway.dispatch import AgentLink
from gateway.state import GatewayState
from platform_site import telemetry
from platform_site.asgi import application
from serving_agent import Batcher, FunctionRuntime
from serving_agent import telemetry as agent_telemetry
from serving_agent._serving import Serving
from serving_agent._versions import Loaded
from serving_agent.protocol import TensorSpec, VersionSpec, unpack_frames
from tests.factories import make_model, make_version
from tests.otlp_receiver import Span, otlp_receiver
from tests.test_generation import (
    FakeAgent,
    frames_until_end,
    make_textgen,
    openai_with,
    run,
    socket,
)

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SERVER, CONSUMER = 2, 5  # OTLP's span kinds


@pytest.fixture(params=["grpc", "http/protobuf"])
def receiver(request, monkeypatch):
    """A receiver of each protocol; the gateway's and the agent's pipelines send to it."""
    with otlp_receiver(request.param) as got:
        for name, value in got.env().items():
            monkeypatch.setenv(name, value)
        assert telemetry.configure("switchyard-gateway") is not None
        assert agent_telemetry.configure("switchyard-agent") is not None
        try:
            yield got
        finally:
            telemetry.shutdown()
            agent_telemetry.configure(env={})


def flush() -> None:
    assert telemetry.flush()
    assert agent_telemetry.exporting is None or agent_telemetry.exporting.flush()


# The platform in process: the ASGI app, its gateway state, and an agent's Serving -------------


class InProcessAgent:
    """The agent's real ``Serving`` on a link of the gateway's pool: frames go to it as the
    websocket would carry them, its replies come back to the pool."""

    def __init__(self, state: GatewayState, version_id: int, artifact: bytes) -> None:
        session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
        runtime = FunctionRuntime(lambda feeds: session.run(None, feeds), ["x"], ["y"])
        spec = VersionSpec(
            version_id=version_id,
            model="clf",
            version=1,
            sha256="0" * 64,
            artifact_url="/unused",
            inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1, 4])],
            outputs=[TensorSpec(name="y", datatype="FP32", shape=[-1, 2])],
            max_batch_size=8,
        )
        self.pool = state.pool
        self.link = AgentLink("in-process", self._to_agent)
        self.serving = Serving({version_id: Loaded(spec, runtime, Batcher(runtime))}, self)
        self.pool.add(self.link)
        self.pool.set_ready(self.link, version_id, True)

    async def _to_agent(self, message: bytes) -> None:
        for frame in unpack_frames(message):
            self.serving.handle_frame(frame)

    async def send_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.pool.deliver(self.link, frame)

    def stream_sender(self):  # pragma: no cover - no streams here
        raise AssertionError("no streams here")


@pytest.fixture
def platform(world, onnx_bytes, monkeypatch, settings):
    settings.SWITCHYARD_PREDICTION_LOG = False  # its writer thread would outlive the test db
    gateway = GatewayState()
    monkeypatch.setattr(oip, "get_state", lambda: gateway)
    monkeypatch.setattr(state_module, "get_state", lambda: gateway)
    version = make_version(make_model(world.a), onnx_bytes)
    InProcessAgent(gateway, version.pk, onnx_bytes)
    return world


def infer(
    key: str, headers: dict[str, str] | None = None, body: dict | None = None, model: str = "clf"
):
    """(status, headers) of one OIP request through the ASGI application."""
    return infer_many(key, [headers or {}], body, model)[0]


def infer_many(key: str, each: list[dict[str, str]], body: dict | None = None, model: str = "clf"):
    """Requests one after the other in one event loop (the agent's batcher lives in one)."""
    x = np.ones((2, 4), np.float32)
    tensor = {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": x.ravel().tolist()}
    payload = json.dumps(body if body is not None else {"inputs": [tensor]}).encode()

    async def go():
        answers = []
        for headers in each:
            sent = [(b"authorization", f"Bearer {key}".encode())]
            sent += [(k.encode(), v.encode()) for k, v in headers.items()]
            path = f"/v2/models/{model}/infer"
            communicator = HttpCommunicator(application, "POST", path, body=payload, headers=sent)
            response = await communicator.get_response(timeout=10)
            got = {k.decode().lower(): v.decode() for k, v in response["headers"]}
            answers.append((response["status"], got))
        return answers

    return async_to_sync(go)()


def by_name(found: list[Span]) -> dict[str, list[Span]]:
    named: dict[str, list[Span]] = {}
    for span in found:
        named.setdefault(span.name, []).append(span)
    return named


def test_the_whole_tree_of_one_request_arrives_with_the_right_parents(platform, receiver):
    sampled = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    status, headers = infer(platform.key_a, {"traceparent": sampled})
    assert status == 200
    _, trace_id, door_id, flags = headers["traceparent"].split("-")
    assert (trace_id, flags) == (CALLER_TRACE, "01")  # the caller's trace, and recorded
    flush()
    found = receiver.wait_for(CALLER_TRACE, 11)
    named = by_name(found)

    # The door: the span the response named, a child of the caller's, as HTTP's conventions say.
    (door,) = named["POST /v2/models/{model}/infer"]
    assert (door.span_id, door.parent_id, door.kind) == (door_id, CALLER_SPAN, SERVER)
    assert door.service == "switchyard-gateway" and not door.error
    assert door.attributes == {
        "http.request.method": "POST",
        "url.path": "/v2/models/clf/infer",
        "http.route": "/v2/models/{model}/infer",
        "http.response.status_code": 200,
        "switchyard.request.id": headers["x-request-id"],
        "switchyard.tenant": "alpha",
        "switchyard.model": "clf",
        "switchyard.version": 1,
    }
    # Its stages, children of the door, within it and in order.
    stages = sorted(
        (s for s in found if s.parent_id == door_id and s.service == "switchyard-gateway"),
        key=lambda s: s.start_ns,
    )
    assert [s.name for s in stages] == [
        "switchyard.auth",
        "switchyard.rate_limit",
        "switchyard.routing",  # the route
        "switchyard.serialization",  # the request parsed
        "switchyard.routing",  # the arm
        "switchyard.dispatch",
        "switchyard.serialization",  # the reply rendered
    ]
    for earlier, later in zip(stages, stages[1:], strict=False):
        assert earlier.end_ns <= later.start_ns
    assert door.start_ns <= stages[0].start_ns and stages[-1].end_ns <= door.end_ns
    dispatch = named["switchyard.dispatch"][0]
    assert dispatch.attributes.keys() == {
        "switchyard.agent.queue_ms",
        "switchyard.agent.compute_ms",
    }

    # The agent's: its request is a child of the door (the span its frame named), its wait for
    # a batch and the batch's run children of that.
    (on_agent,) = named["switchyard.agent.infer"]
    assert (on_agent.service, on_agent.parent_id, on_agent.kind) == (
        "switchyard-agent",
        door_id,
        SERVER,
    )
    assert on_agent.attributes["switchyard.priority"] == "interactive"
    (queue,) = named["switchyard.agent.queue"]
    (run,) = named["switchyard.agent.run"]
    assert queue.parent_id == run.parent_id == on_agent.span_id
    assert queue.end_ns <= run.start_ns <= run.end_ns <= on_agent.end_ns
    assert len(found) == 11 and len({s.span_id for s in found}) == 11


def test_an_unsampled_request_exports_nothing_and_says_so(platform, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    telemetry.configure("switchyard-gateway")
    # A caller's sampled trace is followed even at ratio 0 (parent-based); an unsampled one not.
    unsampled = {"traceparent": f"00-{'ab' * 16}-{CALLER_SPAN}-00"}
    sampled = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    answers = infer_many(platform.key_a, [{}, unsampled, sampled])
    assert [status for status, _ in answers] == [200, 200, 200]
    flags = [headers["traceparent"][-2:] for _, headers in answers]
    assert flags == ["00", "00", "01"]
    fresh_trace = answers[0][1]["traceparent"].split("-")[1]
    flush()
    assert len(receiver.wait_for(CALLER_TRACE, 11)) == 11
    assert receiver.of_trace(fresh_trace) == [] and receiver.of_trace("ab" * 16) == []


def test_a_refused_request_is_a_door_span_with_its_status(platform, receiver):
    sampled = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    status, headers = infer(platform.key_a, {"traceparent": sampled}, body={"inputs": "x"})
    assert status == 400
    flush()
    found = by_name(receiver.wait_for(CALLER_TRACE, 4))
    (door,) = found.pop("POST /v2/models/{model}/infer")
    # Admitted, then refused while parsing: its stages up to there, and nothing on an agent.
    assert set(found) == {"switchyard.auth", "switchyard.rate_limit", "switchyard.routing"}
    assert door.attributes["http.response.status_code"] == 400
    assert not door.error  # a client's error is not the server's (HTTP's conventions)
    assert door.span_id == headers["traceparent"].split("-")[2]


@pytest.mark.parametrize(
    "hostile",
    [
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",  # all-zero parent
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # an unknown version
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
        "00-" + "a" * 5000,
        "\x00\x01-01",
    ],
)
def test_a_malformed_traceparent_starts_a_trace_of_our_own(platform, receiver, hostile):
    status, headers = infer(platform.key_a, {"traceparent": hostile})
    assert status == 200
    _, trace_id, _, flags = headers["traceparent"].split("-")
    assert trace_id != CALLER_TRACE and flags == "01"  # sampled here: always_on by default
    flush()
    door = receiver.wait_for(trace_id, 11)
    assert any(s.name.startswith("POST") and s.parent_id == "" for s in door)


def test_an_agent_ignores_a_malformed_trace_in_its_frame(receiver):
    """The platform is trusted to send a traceparent, but the agent parses what arrives: a bad
    one is no span, never a failed request."""
    from serving_agent._serving import record_spans
    from serving_agent.protocol import FrameTensor, InferRequest, Member

    x = FrameTensor(name="x", datatype="FP32", shape=[1, 4])
    members = [Member(1, 1, "00-zz-bad-01"), Member(2, 1, "garbage-01"), Member(3, 1, "")]
    request = InferRequest(id=9, version_id=1, inputs=[x], members=members)
    record_spans(request, 0.0, 0.001, 0.0, 0.0)  # nothing raised
    flush()
    assert receiver.spans == []


def test_tracing_is_off_by_default_and_fresh_traces_then_say_unsampled(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert telemetry.configure() is None and telemetry.exporting is None
    assert tracing.start_trace(None, None).flags == "00"
    # A caller's decision is passed on (nothing here records it).
    kept = tracing.start_trace(None, f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")
    assert (kept.trace_id, kept.parent_id, kept.flags) == (CALLER_TRACE, CALLER_SPAN, "01")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert telemetry.configure() is None


@pytest.mark.parametrize(
    "env, fresh, followed",
    [
        ({}, "01", "01"),  # parentbased_always_on
        ({"OTEL_TRACES_SAMPLER": "always_off"}, "00", "00"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, "00", "00"),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
            "00",
            "01",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"},
            "01",
            "01",
        ),
        # Hostile settings: logged, and the defaults used.
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "01", "01"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "nan"}, "01", "01"),
    ],
)
def test_the_sampler_settings_decide_fresh_traces_and_follow_callers(env, fresh, followed):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    try:
        telemetry.configure(
            env={"OTEL_TRACES_EXPORTER": "otlp", **env}, exporter=InMemorySpanExporter()
        )
        assert tracing.start_trace(None, None).flags == fresh
        assert tracing.start_trace(None, f"00-{CALLER_TRACE}-{CALLER_SPAN}-01").flags == followed
    finally:
        telemetry.shutdown()


def test_a_ratio_samples_about_its_share_of_fresh_traces():
    sampling = agent_telemetry.sampling_from_env(
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    )
    rng = np.random.default_rng(3)
    picked = sum(sampling.root(rng.bytes(16).hex()) for _ in range(20_000))
    assert 1700 < picked < 2300


# Graph nodes -------------------------------------------------------------------------------


def test_each_graph_node_is_a_span_and_its_agents_spans_are_its_children(receiver):
    trace = tracing.Trace("r", CALLER_TRACE, CALLER_SPAN, "01")
    scope = {"method": "POST", "path": "/v2/models/g/infer"}
    timeline = spans.Timeline(trace, spans.HttpDoor(spans.oip_route, spans.scope_request), scope)
    graph = type("G", (), {"model_name": "g", "version": 1})()
    sent: list[str] = []

    async def scenario() -> None:
        outer = spans.NodeSpan(timeline, "pre", graph)  # type: ignore[arg-type]
        inner = spans.NodeSpan(timeline, "inner", graph)  # type: ignore[arg-type]
        sent.append(spans.node_trace(trace).traceparent)  # type: ignore[union-attr]
        inner.close(200)
        outer.close(502)
        sent.append(spans.node_trace(trace).traceparent)  # type: ignore[union-attr]

    asyncio.run(scenario())
    spans.export(timeline, 502)
    flush()
    found = by_name(receiver.wait_for(CALLER_TRACE, 3))
    pre, inner = sorted(found["switchyard.graph.node"], key=lambda s: s.start_ns)
    (door,) = found["POST /v2/models/{model}/infer"]
    assert pre.parent_id == door.span_id == CALLER_SPAN and inner.parent_id == pre.span_id
    assert pre.error and pre.attributes["switchyard.status_code"] == 502
    assert inner.attributes["switchyard.graph.node"] == "inner" and not inner.error
    # The node's dispatch names the node's span; outside any node, the request's.
    assert sent == [f"00-{CALLER_TRACE}-{inner.span_id}-01", trace.traceparent]


# Celery --------------------------------------------------------------------------------------


def test_a_celery_task_is_a_span_under_whoever_queued_it(receiver):
    app = Celery("otel-test", broker="memory://")
    app.conf.task_always_eager = False
    published: list[dict] = []

    @app.task(name="tests.child")
    def child() -> str:
        return "done"

    @app.task(name="tests.parent")
    def parent() -> None:
        headers: dict = {}
        # What Celery does before publishing: the running task's context goes in the headers.
        telemetry._publishing(headers=headers)
        published.append(headers)

    telemetry.trace_celery()
    parent.apply()
    (headers,) = published
    _, trace_id, parent_id, flags = headers["traceparent"].split("-")
    assert agent_telemetry.sampled(flags)  # (the SDK also sets W3C level 2's "random" bit)
    child.apply(headers=headers)
    # A broken header from the broker starts a new trace, nothing fails.
    child.apply(headers={"traceparent": "00-nonsense"})
    flush()
    found = receiver.wait_for(trace_id, 2)
    named = by_name(found)
    (outer,) = named["process tests.parent"]
    (inner,) = named["process tests.child"]
    assert outer.span_id == parent_id and inner.parent_id == parent_id
    assert (inner.kind, inner.service) == (CONSUMER, "switchyard-gateway")
    assert inner.attributes["celery.task.name"] == "tests.child"
    assert inner.attributes["celery.state"] == "SUCCESS"
    alone = [
        s for s in receiver.spans if s.name == "process tests.child" and s.trace_id != trace_id
    ]
    assert len(alone) == 1 and alone[0].parent_id == ""


def test_a_failing_celery_task_span_says_why_by_type_only(receiver):
    app = Celery("otel-test", broker="memory://")

    @app.task(name="tests.fails")
    def fails() -> None:
        raise ValueError("secret input 1234")

    telemetry.trace_celery()
    fails.apply()
    flush()
    (span,) = receiver.wait_for_name("process tests.fails", 1)
    assert span.error and span.attributes["error.type"] == "ValueError"
    assert "1234" not in json.dumps(span.attributes)


def test_off_means_no_span_objects_on_the_hot_path(platform, monkeypatch):
    """With tracing off a request's Observed is the plain one and nothing is exported."""
    telemetry.shutdown()
    made: list[object] = []
    monkeypatch.setattr(spans.Timeline, "__init__", lambda *a: made.append(a))
    status, headers = infer(platform.key_a, {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    assert status == 200 and made == []


def test_a_generation_span_says_tokens_and_the_first_token(receiver):
    route = type("R", (), {"model_name": "tiny", "version": 3})()
    trace = tracing.Trace("r", CALLER_TRACE, CALLER_SPAN, "01")
    spans.export_generation(
        trace,
        operation="chat",
        route=route,  # type: ignore[arg-type]
        tenant="alpha",
        arm="b",
        started=0.5,
        input_tokens=7,
        output_tokens=12,
        ttft_ms=40.0,
        finish_reason="length",
        status=200,
    )
    flush()
    (span,) = receiver.wait_for(CALLER_TRACE, 1)
    assert (span.name, span.parent_id) == ("chat tiny", CALLER_SPAN)
    assert span.attributes["gen_ai.usage.input_tokens"] == 7
    assert span.attributes["gen_ai.usage.output_tokens"] == 12
    assert span.attributes["gen_ai.server.time_to_first_token"] == pytest.approx(0.04)
    assert span.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert span.attributes["switchyard.arm"] == "b" and span.events == ("gen_ai.first_token",)


# Generation: the websocket's and OpenAI's doors, and each generation's GenAI span ----------


@pytest.fixture
def writer(world, monkeypatch):
    """Tenant A's text model ``writer`` (tests/test_generation.py's), and one gateway state
    for both generation doors."""
    if os.environ.get("REDIS_URL"):  # the tenants' generation budgets start empty
        import redis

        client = redis.Redis.from_url(os.environ["REDIS_URL"])
        for key in client.scan_iter("sy:gen:*"):
            client.delete(key)
    version = make_textgen(make_model(world.a, "writer", task="generator"))
    gateway = GatewayState()
    monkeypatch.setattr(generate_ws, "get_state", lambda: gateway)
    monkeypatch.setattr(openai_api, "get_state", lambda: gateway)
    world.version, world.state = version, gateway
    return world


@pytest.mark.django_db(transaction=True)
def test_a_generation_on_each_door_is_a_door_span_and_a_genai_span(writer, receiver):
    sampled = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"

    async def scenario():
        FakeAgent(writer.state, writer.version.pk)
        handshake = [(b"traceparent", sampled.encode())]
        async with socket(writer.key_a, headers=handshake) as ws:
            await ws.send_json_to({"type": "generate", "id": "g1", "prompt": "call me"})
            await frames_until_end(ws, "g1")
        body = {"model": "writer", "messages": [{"role": "user", "content": "hi"}]}
        post = openai_with(writer.key_a, "/v1/chat/completions", body, {"traceparent": sampled})
        return await post()

    response, _ = run(scenario)
    assert response.status_code == 200
    flush()
    found = by_name(receiver.wait_for(CALLER_TRACE, 4))
    (ws_door,) = found["generate /ws/v1/models/{name}/generate"]
    (chat_door,) = found["POST /v1/chat/completions"]
    assert ws_door.parent_id == chat_door.parent_id == CALLER_SPAN
    assert chat_door.span_id == response["traceparent"].split("-")[2]
    assert chat_door.attributes["gen_ai.operation.name"] == "chat"
    (completion,) = found["text_completion writer"]
    (chat,) = found["chat writer"]
    assert completion.parent_id == ws_door.span_id and chat.parent_id == chat_door.span_id
    tokens = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens")
    assert [completion.attributes[k] for k in tokens] == [7, 7]
    assert completion.events == ("gen_ai.first_token",)
    assert completion.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert "hi" not in json.dumps(chat.attributes) and "call me" not in json.dumps(
        completion.attributes
    )


def test_a_worker_process_sets_up_its_own_pipeline_as_it_starts(receiver):
    from celery import signals

    telemetry.trace_celery()
    before = telemetry.exporting
    signals.worker_process_init.send(sender=None)
    assert telemetry.exporting is not None and telemetry.exporting is not before
    assert telemetry.exporting.resource.attributes["service.name"] == "switchyard-worker"


def test_a_tracing_failure_is_logged_never_the_requests(platform, receiver, monkeypatch, caplog):
    def broken(*args: object) -> None:
        raise RuntimeError("an exporter bug")

    monkeypatch.setattr(telemetry.exporting, "span", broken)
    monkeypatch.setattr(agent_telemetry.exporting, "span", broken)
    status, _ = infer(platform.key_a, {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    assert status == 200
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("could not record the spans of request" in m for m in logged)
    assert sum("could not record" in m for m in logged) == 2  # the gateway's, the agent's


def test_a_graph_request_has_a_span_per_node_and_each_nodes_frame_names_it(
    world, monkeypatch, settings, receiver
):
    from tests.test_fallback_ladder import Agent
    from tests.test_graphs import CLF, PRE, artifact, make_graph, node

    settings.SWITCHYARD_PREDICTION_LOG = False
    gateway = GatewayState()
    monkeypatch.setattr(oip, "get_state", lambda: gateway)
    monkeypatch.setattr(state_module, "get_state", lambda: gateway)
    agents = {}
    for name, shape in (("pre", PRE), ("clf", CLF)):
        version = make_version(make_model(world.a, name), artifact(*shape))
        agents[name] = Agent(gateway, version.pk, artifact(*shape), name)
    make_graph(world, "g", {"sequence": [node("pre", 1), node("clf", 1, inputs={"x": "y"})]})

    sampled = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    status, headers = infer(world.key_a, {"traceparent": sampled}, model="g")
    assert status == 200
    door_id = headers["traceparent"].split("-")[2]
    flush()
    found = by_name(receiver.wait_for(CALLER_TRACE, 9))
    nodes = {s.attributes["switchyard.graph.node"]: s for s in found["switchyard.graph.node"]}
    assert set(nodes) == {"pre", "clf"}
    assert all(
        n.parent_id == door_id and n.attributes["switchyard.graph.model"] == "g"
        for n in nodes.values()
    )
    assert nodes["pre"].end_ns <= nodes["clf"].start_ns  # a sequence
    # Each node's frame named its node's span: the agent's spans hang under the node.
    for name, agent in agents.items():
        assert agent.requests[-1].trace == f"00-{CALLER_TRACE}-{nodes[name].span_id}-01"


def test_the_agents_engine_records_a_sampled_streams_generation_span(receiver):
    from serving_agent._generate import Engine
    from serving_agent.protocol import GenerateRequest
    from serving_agent.textgen import from_safetensors
    from tests.agent.test_generate import Collector
    from tests.textgen_models import tiny_textgen

    model = from_safetensors(tiny_textgen(), "cpu")
    other = "ab" * 16

    def request(request_id: int, traceparent: str) -> GenerateRequest:
        return GenerateRequest(
            id=request_id,
            version_id=1,
            prompt="Call me",
            max_new_tokens=5,
            temperature=0.0,
            trace=traceparent,
        )

    async def scenario() -> None:
        engine, out = Engine(model), Collector()
        engine.submit(request(1, f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"), out)
        engine.submit(request(2, f"00-{other}-{CALLER_SPAN}-00"), out)
        engine.submit(request(3, "00-not-a-trace-01"), out)  # ignored, the stream goes on
        for request_id in (1, 2, 3):
            await out.wait(request_id)
        await engine.stop()

    asyncio.run(scenario())
    flush()
    (span,) = receiver.wait_for(CALLER_TRACE, 1)
    assert (span.name, span.parent_id, span.service, span.kind) == (
        "switchyard.agent.generate",
        CALLER_SPAN,
        "switchyard-agent",
        SERVER,
    )
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["gen_ai.usage.input_tokens"] == 7
    assert span.attributes["gen_ai.usage.output_tokens"] == 5
    assert span.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert span.attributes["gen_ai.server.time_to_first_token"] > 0
    assert span.events == ("gen_ai.first_token",)
    assert receiver.of_trace(other) == [] and len(receiver.spans) == 1
