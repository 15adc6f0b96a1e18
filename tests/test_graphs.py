"""Graph versions (docs/graphs.md): the document's checks at upload, each hostile one a 400 in
the API's shape naming the problem (cycles, unknown versions, another tenant's models, too many
nodes, too deep, bad conditions, graphs nested past the bound); what agents are assigned for a
served graph; and graphs run through the real ASGI application (OIP v2 REST) against
in-process agent links that run ONNX Runtime: a sequence, an ensemble and a switch equal their
nodes composed by hand, one trace across the nodes, each node within what is left of the
deadline, counted per node, and a failing node named in the protocol's own error shape. The
same with real processes and stock ``tritonclient``: ``tests/e2e/test_graphs_e2e.py``."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import onnxruntime as ort
import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.core.files.uploadedfile import SimpleUploadedFile

from fleet.assignments import scope_versions
from fleet.deployments import create_deployment
from fleet.models import Pool
from fleet.nodes import create_node
from gateway import oip
from gateway import state as state_module
from gateway.api import predict_app
from gateway.state import GatewayState
from platform_site.asgi import application
from platform_site.errors import Invalid
from registry.graph_spec import MAX_DEPTH, MAX_NODES
from registry.models import ModelVersion
from registry.services import create_version, set_alias
from rollouts.actions import start_plan
from tenants.audit import SYSTEM, Actor
from tests.factories import key_client, make_model, make_version
from tests.onnx_models import small_onnx
from tests.test_fallback_ladder import Agent
from tests.textgen_models import tiny_textgen

pytestmark = pytest.mark.django_db


# The nodes: ONNX MLPs with input "x" and output "y" -------------------------------------------


@cache
def artifact(n_in: int, n_out: int, seed: int) -> bytes:
    return small_onnx(n_in, n_out, seed)


PRE, CLF, CLF2, POST = (4, 4, 1), (4, 3, 2), (4, 3, 4), (3, 2, 3)


def run_onnx(shape: tuple[int, int, int], x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(artifact(*shape), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def node(model: str, version: int | None = None, alias: str | None = None, **more) -> dict:
    ref = {"version": version} if version is not None else {"alias": alias or "production"}
    return {"model": model, **ref, **more}


# pre (x -> y, 4 wide) -> clf (reads pre's y as its x; 3 scores) -> post (2 outputs)
SEQUENCE = {
    "sequence": [
        node("pre", 1),
        node("clf", alias="production", inputs={"x": "y"}),
        node("post", 1, inputs={"x": "y"}),
    ]
}


@pytest.fixture
def nodes(world):
    """Tenant A's node models, each v1 in production, and an empty graph model ``g``; tenant
    B's ``secret``."""
    world.versions = {}
    for name, shape in (("pre", PRE), ("clf", CLF), ("clf2", CLF2), ("post", POST)):
        world.versions[name] = make_version(make_model(world.a, name), artifact(*shape))
    world.graph_model = make_model(world.a, "g")
    make_version(make_model(world.b, "secret"), artifact(*CLF))
    world.api = key_client(world.key_a)
    return world


def upload(world, doc: object, model: str = "g", **fields):
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    body = {"artifact": SimpleUploadedFile("graph.json", data), "format": "graph", **fields}
    return world.api.post(f"/api/v1/models/{model}/versions", body, format="multipart")


def refused(response, *words: str) -> str:
    """The 400's message, in the API's error shape, naming the artifact and ``words``."""
    assert response.status_code == 400, response.content
    body = response.json()
    assert set(body["fields"]) == {"artifact"}, body
    for word in words:
        assert word in body["error"], body["error"]
    return body["error"]


def make_graph(world, name: str, doc: dict, alias: str | None = "production") -> ModelVersion:
    model = world.a.models.filter(name=name).first() or make_model(world.a, name)
    return make_version(model, json.dumps(doc).encode(), format="graph", alias=alias)


# Upload: accepted ---------------------------------------------------------------------------


def test_a_graph_upload_derives_its_signature_from_its_nodes(nodes):
    response = upload(nodes, SEQUENCE)
    assert response.status_code == 201, response.content
    version = response.json()
    assert version["format"] == "graph"
    assert version["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert version["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]
    assert version["lineage"]["graph"] == SEQUENCE  # the document, as the gateway reads it


def test_a_declared_signature_must_agree_with_the_nodes(nodes):
    wrong = json.dumps([{"name": "x", "datatype": "FP32", "shape": [-1, 5]}])
    response = upload(nodes, SEQUENCE, inputs=wrong)
    assert response.status_code == 400, response.content
    assert "declared with shape [-1, 5]" in response.json()["error"]


# Upload: hostile documents, each a 400 naming the problem --------------------------------------


@pytest.mark.parametrize(
    "doc, words",
    [
        (b"{not json", ["not a JSON document"]),
        (b"[" * 5000 + b"]" * 5000, ["not a JSON document"]),  # nesting past orjson's limit
        (b" " * (64 * 1024 + 1), ["at most 65536 bytes"]),
        ([], ["graph: must be an object"]),
        ({"pipeline": []}, ["exactly one of a node"]),
        ({"sequence": [], "model": "pre"}, ["exactly one of"]),
        ({"sequence": []}, ["graph.sequence: must be a list of at least 1 step"]),
        ({"ensemble": [node("clf", 1)], "combine": "mean"}, ["at least 2 steps"]),
        ({"ensemble": [node("clf", 1), node("clf2", 1)], "combine": "median"}, ["mean, sum"]),
        ({"sequence": [{"model": "pre"}]}, ["'version' (a number) or by 'alias'"]),
        ({"model": "pre", "version": 1, "alias": "production"}, ["one of the two"]),
        ({"sequence": [node("pre", True)]}, ["graph.sequence[0].version: must be a positive"]),
        ({"sequence": [node("pre", 1, extra=1)]}, ["unknown key 'extra'"]),
        ({"sequence": [node("pre", 1), node("pre", 1)]}, ["'pre' names two nodes"]),
        ({"sequence": [node("pre", 1, name="a b")]}, ["graph.sequence[0].name"]),
        ({"sequence": [node("pre", 1, inputs={"x": 3})]}, ["must name a tensor"]),
        (
            {"switch": [{"when": {"input": "x", "op": ">", "value": 0}, "then": node("clf", 1)}]},
            ["a switch needs a 'default' branch"],
        ),
    ],
)
def test_a_malformed_document_is_refused_naming_where(nodes, doc, words):
    refused(upload(nodes, doc), *words)
    assert not ModelVersion.objects.filter(model__name="g").exists()


def switch(when: dict, then: dict | None = None, default: dict | None = None) -> dict:
    return {
        "switch": [{"when": when, "then": then or node("clf", 1)}],
        "default": default or node("clf2", 1),
    }


@pytest.mark.parametrize(
    "when, words",
    [
        ({"input": "x", "op": "~", "value": 0}, ["switch[0].when.op: must be one of"]),
        ({"input": "x", "op": ">", "value": 0, "reduce": "most"}, ["reduce: must be one of"]),
        ({"input": "x", "op": ">", "value": [1]}, ["must be a finite number, a string"]),
        ({"input": "x", "op": ">", "value": "high"}, ["a string or boolean takes == or !="]),
        ({"input": "x", "op": "==", "value": "high"}, ["'x' is FP32: compare it with a number"]),
        ({"input": "z", "op": ">", "value": 0}, ["input 'z' is no tensor of the graph there"]),
        ({"input": "x", "op": ">", "value": 0, "then": 1}, ["unknown key 'then'"]),
    ],
)
def test_a_bad_switch_condition_is_refused(nodes, when, words):
    refused(upload(nodes, switch(when)), *words)


def test_nodes_must_name_versions_that_exist(nodes):
    refused(upload(nodes, {"sequence": [node("pre", 9)]}), "graph node 'pre'", "no version 9")
    refused(upload(nodes, {"sequence": [node("pre", alias="staging")]}), "no alias 'staging'")
    refused(upload(nodes, {"sequence": [node("nope", 1)]}), "model 'nope' not found")


def test_another_tenants_model_is_not_found_as_if_it_did_not_exist(nodes):
    """Tenant B has ``secret``; tenant A's graph naming it is told exactly what a name that
    exists nowhere is told, so nothing leaks across tenants, and B's version is not served."""
    theirs = refused(upload(nodes, {"sequence": [node("secret", 1)]}))
    nowhere = refused(upload(nodes, {"sequence": [node("secrets", 1)]}))
    assert theirs.replace("'secret'", "'X'") == nowhere.replace("'secrets'", "'X'")
    assert "not found" in theirs


def test_tensors_that_do_not_fit_are_refused_naming_the_node(nodes):
    # post takes 3 wide; pre gives 4
    doc = {"sequence": [node("pre", 1), node("post", 1, inputs={"x": "y"})]}
    refused(upload(nodes, doc), "graph node 'post'", "FP32 [-1, 3]", "'y' is FP32 [-1, 4]")
    doc = {"sequence": [node("pre", 1, inputs={"z": "x"})]}
    refused(upload(nodes, doc), "graph node 'pre'.inputs", "takes no input 'z'")
    # Members whose outputs differ cannot be averaged; branches must agree.
    mixed = {"ensemble": [node("clf", 1), node("pre", 1)], "combine": "mean"}
    refused(upload(nodes, mixed), "output 'y': is FP32 [-1, 3] in one member and FP32 [-1, 4]")
    renamed = {"ensemble": [node("clf", 1), node("clf2", 1, outputs={"y": "z"})], "combine": "sum"}
    refused(upload(nodes, renamed), "sum combines outputs of the same names")
    branches = switch({"input": "x", "op": ">", "value": 0}, default=node("pre", 1))
    refused(upload(nodes, branches), "output 'y' is FP32 [-1, 3] in one branch")


def test_too_many_nodes_is_refused(nodes):
    members = [node("clf", 1, name=f"m{i}") for i in range(MAX_NODES + 1)]
    refused(upload(nodes, {"ensemble": members, "combine": "mean"}), f"at most {MAX_NODES} nodes")


def test_compositions_nested_too_deep_are_refused(nodes):
    doc: dict = node("pre", 1)
    for _ in range(MAX_DEPTH):
        doc = {"sequence": [doc]}
    assert upload(nodes, doc).status_code == 201  # four deep is the bound
    refused(upload(nodes, {"sequence": [doc]}), f"compositions nest at most {MAX_DEPTH} deep")


def test_a_graph_naming_graphs_past_the_depth_is_refused(nodes):
    """Each graph is a level: a chain of graphs, each naming the one before, stops at the
    bound, however small each is."""
    make_graph(nodes, "level1", {"sequence": [node("pre", 1)]})
    for level in range(2, MAX_DEPTH + 1):
        make_graph(nodes, f"level{level}", {"sequence": [node(f"level{level - 1}", 1)]})
    error = refused(upload(nodes, {"sequence": [node(f"level{MAX_DEPTH}", 1)]}))
    assert f"at most {MAX_DEPTH}" in error


def test_nested_graphs_count_towards_the_node_bound(nodes):
    make_graph(nodes, "pair", {"ensemble": [node("clf", 1), node("clf2", 1)], "combine": "mean"})
    members = [node("pair", 1, name=f"p{i}") for i in range(MAX_NODES // 2 + 1)]
    error = refused(upload(nodes, {"ensemble": members, "combine": "mean"}))
    assert f"expands to {2 * len(members)} model calls" in error


def test_a_cycle_through_aliases_is_refused(nodes):
    """Versions only name older versions, so a cycle needs an alias moved after an upload:
    a@production -> a v2 -> b@production -> b v1 -> a@production."""
    make_graph(nodes, "a", node("pre", 1))
    make_graph(nodes, "b", node("a", alias="production"))
    a2 = make_graph(nodes, "a", node("b", alias="production"), alias=None)
    set_alias(a2.model, "production", a2)
    refused(upload(nodes, {"sequence": [node("a", alias="production")]}), "a cycle")


def test_a_text_generation_node_is_refused(nodes):
    make_version(make_model(nodes.a, "llm", task="generator"), tiny_textgen(), format="textgen")
    refused(upload(nodes, {"sequence": [node("llm", 1)]}), "generates text")


# What agents serve ----------------------------------------------------------------------------


def test_agents_are_assigned_a_graphs_nodes_never_the_graph(nodes):
    """A pinned node version no alias points at is loaded for the graph that names it."""
    pinned = create_version(nodes.versions["post"].model, artifact(*POST))  # v2, no alias
    doc = {"sequence": [node("pre", 1), node("clf", alias="production", inputs={"x": "y"})]}
    doc["sequence"].append(node("post", pinned.version, inputs={"x": "y"}))
    graph = make_graph(nodes, "g", doc)
    node_row, _ = create_node("box", nodes.a)
    served = set(scope_versions(node_row).values_list("pk", flat=True))
    assert pinned.pk in served and graph.pk not in served
    assert {v.pk for v in nodes.versions.values()} <= served


def test_a_graph_cannot_be_deployed_on_agents(nodes):
    graph = make_graph(nodes, "g", SEQUENCE)
    with pytest.raises(Invalid, match="runs on the gateway"):
        create_deployment(graph, Pool.objects.create(name="p", backend="local"), {}, SYSTEM)


# Running graphs on the gateway -----------------------------------------------------------------


@pytest.fixture
def state(monkeypatch, settings) -> GatewayState:
    settings.SWITCHYARD_INFER_TIMEOUT_S = 2
    # Not what is tested here, and its writer thread would outlive the test's database.
    settings.SWITCHYARD_PREDICTION_LOG = False
    gateway = GatewayState()
    monkeypatch.setattr(oip, "get_state", lambda: gateway)
    monkeypatch.setattr(predict_app, "get_state", lambda: gateway)
    monkeypatch.setattr(state_module, "get_state", lambda: gateway)
    return gateway


@pytest.fixture
def served(nodes, state):
    """An in-process agent link per node version, and graph ``g`` (the sequence) in
    production."""
    shapes = {"pre": PRE, "clf": CLF, "clf2": CLF2, "post": POST}
    nodes.agents = {
        name: Agent(state, v.pk, artifact(*shapes[name]), name)
        for name, v in nodes.versions.items()
    }
    nodes.graph = make_graph(nodes, "g", SEQUENCE)
    return nodes


def call(key: str, path: str, x: np.ndarray | None = None, headers: dict | None = None):
    async def go():
        sent = [(b"authorization", f"Bearer {key}".encode())]
        sent += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        if x is None:
            communicator = HttpCommunicator(application, "GET", path, headers=sent)
        else:
            tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}
            body = json.dumps({"inputs": [tensor]}).encode()
            communicator = HttpCommunicator(application, "POST", path, body=body, headers=sent)
        response = await communicator.get_response(timeout=10)
        got = {k.decode().lower(): v.decode() for k, v in response["headers"]}
        return response["status"], got, json.loads(response["body"])

    return async_to_sync(go)()


def tensor(answer: dict, index: int = 0) -> np.ndarray:
    out = answer["outputs"][index]
    dtype = np.int64 if out["datatype"] == "INT64" else np.float32
    return np.array(out["data"], dtype=dtype).reshape(out["shape"])


def test_a_sequence_answers_its_nodes_composed_by_hand(served, state, rng):
    x = rng.normal(size=(5, 4)).astype(np.float32)
    status, headers, answer = call(served.key_a, "/v2/models/g/infer", x)
    assert status == 200, answer
    assert (answer["model_name"], answer["model_version"]) == ("g", "1")
    by_hand = run_onnx(POST, run_onnx(CLF, run_onnx(PRE, x)))
    np.testing.assert_allclose(tensor(answer), by_hand, rtol=1e-5, atol=1e-6)

    # One trace across the graph: every node's frame carries the request's traceparent.
    sent = [a.requests[-1] for a in (served.agents[n] for n in ("pre", "clf", "post"))]
    assert {request.trace for request in sent} == {headers["traceparent"]}
    # Counted per node (graph model and version, node name) and for the graph's own version.
    for name in ("pre", "clf", "post"):
        assert state.metrics.graph_nodes[("alpha", "g", "1", name)].counts
    assert not state.metrics.graph_node_errors
    counts = {vid: c for (vid, _), c in state.traffic.drain().items()}
    assert counts[served.graph.pk].requests == 1 and counts[served.graph.pk].errors == 0
    assert counts[served.versions["clf"].pk].requests == 1  # each node its own version's


def test_an_ensemble_and_a_switch_answer_their_nodes_combined_by_hand(served, rng):
    make_graph(served, "avg", {"ensemble": [node("clf", 1), node("clf2", 1)], "combine": "mean"})
    make_graph(served, "votes", {"ensemble": [node("clf", 1), node("clf2", 1)], "combine": "vote"})
    positive = {"input": "x", "op": ">", "value": 0, "reduce": "all"}
    make_graph(served, "pick", switch(positive))
    x = rng.normal(size=(6, 4)).astype(np.float32)
    a, b = run_onnx(CLF, x), run_onnx(CLF2, x)

    status, _, answer = call(served.key_a, "/v2/models/avg/infer", x)
    assert status == 200, answer
    np.testing.assert_allclose(tensor(answer), (a + b) / 2, rtol=1e-5, atol=1e-6)

    status, _, answer = call(served.key_a, "/v2/models/votes/infer", x)
    assert status == 200 and answer["outputs"][0]["datatype"] == "INT64", answer
    # Two voters: a tie goes to the first member's label.
    np.testing.assert_array_equal(tensor(answer), a.argmax(1))

    for sample, want in ((np.abs(x) + 0.1, CLF), (x - 10, CLF2)):
        status, _, answer = call(served.key_a, "/v2/models/pick/infer", sample)
        assert status == 200, answer
        np.testing.assert_allclose(tensor(answer), run_onnx(want, sample), rtol=1e-5, atol=1e-6)


def test_a_failing_node_fails_the_request_naming_it(served, state, rng):
    served.agents["clf"].mode = "error"
    status, _, answer = call(served.key_a, "/v2/models/g/infer", rng.normal(size=(2, 4)))
    assert status == 500
    assert answer["error"].startswith("graph node 'clf' ('clf'@production, v1): agent error")
    assert state.metrics.graph_node_errors == {("alpha", "g", "1", "clf", "500"): 1}
    assert not served.agents["post"].requests  # the sequence stopped there
    counts = {vid: c for (vid, _), c in state.traffic.drain().items()}
    assert counts[served.graph.pk].errors == 1  # the graph's own guardrails see it


def test_bad_input_is_a_400_before_any_node_runs(served, rng):
    status, _, answer = call(served.key_a, "/v2/models/g/infer", rng.normal(size=(2, 5)))
    assert status == 400 and "does not match the signature [-1, 4]" in answer["error"]
    assert not any(agent.requests for agent in served.agents.values())


def test_each_node_gets_what_is_left_of_the_deadline(served, rng):
    served.agents["post"].mode = "silent"
    status, _, answer = call(
        served.key_a,
        "/v2/models/g/infer",
        rng.normal(size=(1, 4)),
        {"x-switchyard-timeout-ms": "300"},
    )
    assert status == 504, answer
    assert answer["error"].startswith("graph node 'post'")
    budgets = [served.agents[n].requests[-1].budget_ms for n in ("pre", "clf", "post")]
    assert budgets[0] <= 300 and budgets[0] > budgets[1] > budgets[2]


def test_a_graph_is_ready_when_every_node_is(served):
    status, _, _ = call(served.key_a, "/v2/models/g/ready")
    assert status == 200
    served.agents["post"].pool.set_ready(
        served.agents["post"].link, served.versions["post"].pk, False
    )
    status, _, _ = call(served.key_a, "/v2/models/g/ready")
    assert status == 503


def test_metadata_names_the_gateway_as_the_runtime(served):
    status, _, meta = call(served.key_a, "/v2/models/g")
    assert status == 200 and meta["platform"] == "switchyard_graph"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]


def test_a_cycle_made_after_upload_answers_502_naming_the_node(served, rng):
    make_graph(served, "a", node("pre", 1))
    make_graph(served, "b", node("a", alias="production"))
    a2 = make_graph(served, "a", node("b", alias="production"), alias=None)
    set_alias(a2.model, "production", a2)
    status, _, answer = call(served.key_a, "/v2/models/a/infer", rng.normal(size=(1, 4)))
    assert status == 502, answer
    assert "graph node 'b'" in answer["error"] and "past 4 deep (or in a cycle)" in answer["error"]


def test_another_tenant_cannot_call_the_graph(served, rng):
    status, _, _ = call(served.key_b, "/v2/models/g/infer", rng.normal(size=(1, 4)))
    assert status == 404


def test_a_graph_is_canaried_like_any_version(served, state, rng):
    """A canary from graph v1 (the sequence) to graph v2 (an ensemble): the plan picks the
    graph version per request, the arm is named in the answer, and each graph version's traffic
    is counted for its plan's arm, which the guardrails read."""
    set_alias(served.graph.model, "staging", served.graph)
    ensemble = {"ensemble": [node("clf", 1), node("clf2", 1)], "combine": "mean"}
    v2 = make_graph(served, "g", ensemble, alias=None)
    engineer = Actor(served.engineer_a.pk, "eng-a", "engineer")
    guardrails = {"max_error_rate_increase": 0.05, "max_p99_ratio": 2.0, "min_samples": 100}
    start_plan(served.graph.model, "canary", v2, guardrails, engineer, alias="staging", weight=50)
    x = rng.normal(size=(1, 4)).astype(np.float32)
    arms = {}
    for _ in range(30):
        status, headers, answer = call(served.key_a, "/v2/models/g/versions/staging/infer", x)
        assert status == 200, answer
        arms[headers["x-switchyard-arm"]] = answer
    assert set(arms) == {"baseline", "candidate"}
    assert arms["baseline"]["model_version"] == "1" and arms["candidate"]["model_version"] == "2"
    np.testing.assert_allclose(
        tensor(arms["candidate"]), (run_onnx(CLF, x) + run_onnx(CLF2, x)) / 2, rtol=1e-5
    )
    counted = {(vid, arm) for vid, (_, arm) in state.traffic.drain()}
    assert (served.graph.pk, "baseline") in counted and (v2.pk, "candidate") in counted


def test_the_prediction_api_serves_a_graph_too(served, rng):
    x = rng.normal(size=(3, 4)).astype(np.float32)

    async def go():
        headers = [
            (b"authorization", f"Bearer {served.key_a}".encode()),
            (b"content-type", b"application/json"),
        ]
        body = json.dumps({"instances": x.tolist()}).encode()
        communicator = HttpCommunicator(
            application, "POST", "/api/v1/models/g/predict", body=body, headers=headers
        )
        return await communicator.get_response(timeout=10)

    response = async_to_sync(go)()
    assert response["status"] == 200, response["body"]
    predictions = np.array(json.loads(response["body"])["predictions"], dtype=np.float32)
    by_hand = run_onnx(POST, run_onnx(CLF, run_onnx(PRE, x)))
    np.testing.assert_allclose(predictions, by_hand, rtol=1e-5, atol=1e-6)
