"""A graph version with real processes (docs/graphs.md): three ONNX versions and a graph that
composes them (pre → model → post) uploaded through the API, served by a real agent, called
with stock ``tritonclient.http``: the graph's answer equals its nodes called one by one through
the same client and composed by hand; each node is in ``/metrics`` under the graph's model and
version. One platform (the embedded backend, uvicorn): the gateway path is the same on both
backends, and the node checks, kinds and failures are covered in process (tests/test_graphs.py).
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from prometheus_client.parser import text_string_to_metric_families

from tests.onnx_models import small_onnx

from .conftest import BACKENDS, platform_with_agent, upload_and_promote, wait_ready
from .harness import create_tenant, metrics_auth, wait_until

pytestmark = pytest.mark.e2e

NODES = {"pre": (4, 4, 1), "clf": (4, 3, 2), "post": (3, 2, 3)}  # (inputs, outputs, seed)
GRAPH = {
    "sequence": [
        {"name": "pre", "model": "pre", "version": 1},
        {"name": "clf", "model": "clf", "alias": "production", "inputs": {"x": "y"}},
        {"name": "post", "model": "post", "version": 1, "inputs": {"x": "y"}},
    ]
}


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graphs")
    seed = (("tenant", "t"),)
    with platform_with_agent(BACKENDS[0], tmp, seed=seed) as (backend, url, procs):
        key = create_tenant(backend, "t")
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as api:
            for name, shape in NODES.items():
                upload_and_promote(api, name, small_onnx(*shape))
            created = api.post("/api/v1/models", json={"name": "g", "task": "classifier"})
            assert created.status_code == 201, created.text
            files = {"artifact": ("g.json", json.dumps(GRAPH).encode(), "application/json")}
            graph = api.post("/api/v1/models/g/versions", files=files, data={"format": "graph"})
            assert graph.status_code == 201, graph.text
            moved = api.put("/api/v1/models/g/aliases/production", json={"version": 1})
            assert moved.status_code == 200, moved.text
            wait_ready(api, "g", timeout=60, proc=procs[1])  # every node loaded by the agent
            yield url, headers, api


def infer(url: str, headers: dict[str, str], model: str, x: np.ndarray) -> np.ndarray:
    with triton_http.InferenceServerClient(url.removeprefix("http://")) as client:
        tensor = triton_http.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        wanted = [triton_http.InferRequestedOutput("y", binary_data=True)]
        result = client.infer(model, [tensor], outputs=wanted, headers=headers)
        return result.as_numpy("y")


def test_a_three_node_graph_answers_its_nodes_composed_by_hand(platform, rng):
    url, headers, api = platform
    x = rng.normal(size=(7, 4)).astype(np.float32)
    answer = infer(url, headers, "g", x)
    by_hand = infer(url, headers, "post", infer(url, headers, "clf", infer(url, headers, "pre", x)))
    assert answer.shape == (7, 2)
    np.testing.assert_allclose(answer, by_hand, rtol=1e-6, atol=1e-6)

    # Each node is timed under the graph's model and version (folded every 0.5 s).
    def node_counts() -> dict[str, float] | None:
        text = api.get("/metrics", headers=metrics_auth()).text
        counts = {
            s.labels["node"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "switchyard_graph_node_duration_seconds_count"
            and s.labels.get("model") == "g"
        }
        return counts if len(counts) == 3 else None

    assert wait_until(node_counts, 10) == {"pre": 1.0, "clf": 1.0, "post": 1.0}
