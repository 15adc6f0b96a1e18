"""``/metrics`` after real requests through the whole path (server, agent), request ids and
trace context on every response, and metrics summed over several server processes."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import make_backend
from .harness import free_port, metrics_auth, start_server, wait_until

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
STAGES = {"auth", "rate_limit", "routing", "serialization", "dispatch", "queue_wait", "inference"}


def scrape(client: httpx.Client) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape (with the scrape token)."""
    response = client.get("/metrics", headers=metrics_auth())
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def matching(samples: dict, name: str, **labels: str) -> dict[tuple, float]:
    return {
        key: v
        for key, v in samples.items()
        if key[0] == name and all((k, want) in key[1] for k, want in labels.items())
    }


def body(x: np.ndarray) -> dict:
    return {
        "inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


def test_metrics_count_real_requests_with_their_labels(stack, rng):
    x = rng.normal(size=(2, 4)).astype(np.float32)
    ok = {"tenant": "alpha", "model": "clf", "version": "1", "arm": "", "status": "200"}
    latency = {k: v for k, v in ok.items() if k != "status"}
    with stack.client() as client:
        before = scrape(client)
        for _ in range(70):
            assert client.post("/v2/models/clf/infer", json=body(x)).status_code == 200
        for _ in range(30):
            rows = {"instances": x.tolist()}
            assert client.post("/api/v1/models/clf/predict", json=rows).status_code == 200
        bad = client.post("/v2/models/clf/infer", json={"inputs": [{"name": "x"}]})
        assert bad.status_code == 400
        missing = client.post("/v2/models/nope/infer", json=body(x))
        assert missing.status_code == 404
        after = scrape(client)

    with httpx.Client(base_url=stack.url) as anonymous:
        assert anonymous.post("/v2/models/clf/infer", json=body(x)).status_code == 401
        rejected = scrape(anonymous)

    def delta(name: str, samples: dict = after, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    assert delta("switchyard_requests_total", **ok) == 100
    assert delta("switchyard_requests_total", **{**ok, "status": "400"}) == 1
    assert delta("switchyard_request_duration_seconds_count", **latency) == 101
    assert delta("switchyard_request_duration_seconds_bucket", **latency, le="+Inf") == 101
    assert delta("switchyard_request_duration_seconds_sum", **latency) > 0
    # Rejections by reason: the 404 has a tenant (the key's) but no model route.
    assert delta("switchyard_rejected_requests_total", tenant="alpha", reason="bad_input") == 1
    assert delta("switchyard_rejected_requests_total", tenant="alpha", reason="not_found") == 1
    unauthenticated = {"tenant": "", "reason": "unauthenticated"}
    assert delta("switchyard_rejected_requests_total", rejected, **unauthenticated) == 1
    # Stage times come from one prediction in ten (SWITCHYARD_STAGE_SAMPLE): ten of the hundred
    # answered in a row, with every stage timed; the agent reports its own two.
    stages = {
        dict(key[1])["stage"]: v - before.get(key, 0.0)
        for key, v in matching(
            after, "switchyard_stage_duration_seconds_count", tenant="alpha", model="clf"
        ).items()
    }
    assert STAGES <= set(stages), stages
    assert stages["inference"] == 10 and stages["queue_wait"] == 10

    # Agent metrics come from heartbeats (every 5 s): batch sizes, queue, load time.
    def agent_metrics() -> dict:
        with stack.client() as client:
            samples = scrape(client)
        batches = matching(samples, "switchyard_agent_batch_size_count")
        return samples if batches and max(batches.values()) >= 10 else {}

    samples = wait_until(agent_metrics, 20)
    assert matching(samples, "switchyard_agent_queue_depth")
    assert matching(samples, "switchyard_agent_in_flight")
    loads = matching(samples, "switchyard_model_load_seconds", tenant="alpha", model="clf")
    assert loads and all(v > 0 for v in loads.values())


def test_every_response_carries_a_request_id_and_the_trace(stack, rng):
    x = rng.normal(size=(1, 4)).astype(np.float32)
    traceparent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
    with stack.client() as client:
        given = client.post(
            "/v2/models/clf/infer",
            json=body(x),
            headers={"traceparent": traceparent, "x-request-id": "order-42"},
        )
        assert given.status_code == 200
        assert given.headers["x-request-id"] == "order-42"
        parts = given.headers["traceparent"].split("-")
        assert parts[1] == TRACE_ID and parts[2] != "00f067aa0ba902b7"  # our span, same trace

        fresh = client.post("/api/v1/models/clf/predict", json={"instances": x.tolist()})
        assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])
        # Tracing is off here: a fresh trace says it is not sampled (nothing was recorded).
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00", fresh.headers["traceparent"])

        # An error answer carries them too; an invalid traceparent starts a new trace.
        error = client.post(
            "/v2/models/clf/infer", json={}, headers={"traceparent": "00-zz-bad-01"}
        )
        assert error.status_code == 400 and "x-request-id" in error.headers
        assert TRACE_ID not in error.headers["traceparent"]

        refused = client.post(
            "/v2/models/clf/infer", json=body(x), headers={"x-request-id": "no spaces please"}
        )
        assert refused.status_code == 400 and "x-request-id" in refused.json()["error"]


def test_metrics_are_summed_over_server_processes_and_need_the_token(tmp_path):
    backend = make_backend("embedded", tmp_path)
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    backend.env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    ports = [free_port(), free_port()]
    servers = [start_server(backend, "uvicorn", port) for port in ports]
    try:
        for port, n in zip(ports, (3, 2), strict=True):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
                for _ in range(n):
                    assert client.post("/v2/models/clf/infer", json={}).status_code == 401
        with httpx.Client(base_url=f"http://127.0.0.1:{ports[0]}") as client:
            refused = client.get("/metrics")
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            wrong = client.get("/metrics", headers={"Authorization": "Bearer not-the-token"})
            assert wrong.status_code == 401 and "switchyard_" not in wrong.text

            def summed() -> float:
                samples = scrape(client)
                labels = {"tenant": "", "reason": "unauthenticated"}
                return value(samples, "switchyard_rejected_requests_total", **labels)

            # The other process folds its counts every refresh interval (0.5 s).
            assert wait_until(lambda: summed() == 5, 10)
    finally:
        for server in servers:
            server.stop()
        backend.close()
