"""An INT8 variant with real processes: quantised through the API on a running platform, loaded
by a real agent, answering exactly what ONNX Runtime answers for the same quantised graph made
in the test, and canaried beside its parent, whose arm keeps answering the float graph's
outputs; the plan's metrics count both arms."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from tests.onnx_models import slow_onnx

from .conftest import GUARDRAILS, platform_with_agent, upload_and_promote
from .harness import allow_weight, create_tenant, wait_until

pytestmark = pytest.mark.e2e

ROWS = 8
# Tenant q, whose canaries may carry 50 % without an approval (not the subject here).
SEED = (("tenant", "q"), ("weight", "q", 50))


def _int8(artifact: bytes) -> bytes:
    """The graph quantised as the platform does it (registry.quantize): dynamic, INT8 weights."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        source, target = Path(tmp) / "m.onnx", Path(tmp) / "m.int8.onnx"
        source.write_bytes(artifact)
        quantize_dynamic(source, target, weight_type=QuantType.QInt8)
        return target.read_bytes()


def _run(artifact: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(artifact, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("backend_name", ["embedded", "services"])
def test_a_quantised_variant_is_served_and_canaried(backend_name, tmp_path):
    parent = slow_onnx(width=256, depth=4)
    x = np.random.default_rng(7).standard_normal((ROWS, 4)).astype(np.float32)
    expected = {"1": _run(parent, x), "2": _run(_int8(parent), x)}
    # The two graphs must differ, or the test could not tell which one answered.
    assert np.abs(expected["1"] - expected["2"]).max() > 1e-4
    body = {
        "inputs": [
            {"name": "x", "shape": [ROWS, 4], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }

    with platform_with_agent(backend_name, tmp_path, seed=SEED) as (backend, url, procs):
        key = create_tenant(backend, "q")
        allow_weight(backend, "q", 50)  # a canary of 50 % without an approval: not the subject
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            upload_and_promote(c, "clf", parent)
            made = c.post("/api/v1/models/clf/versions/1/quantize")
            assert made.status_code == 201, made.text
            variant = made.json()
            assert (variant["version"], variant["parent"]) == (2, 1)
            report = variant["lineage"]["quantized"]
            assert report["speedup"] > 0 and report["bytes"]["int8"] < report["bytes"]["original"]

            plan = c.post(
                "/api/v1/models/clf/rollouts",
                json={"mode": "canary", "candidate": 2, "weight": 50, "guardrails": GUARDRAILS},
            )
            assert plan.status_code == 201, plan.text
            ready = "/v2/models/clf/versions/2/ready"
            wait_until(lambda: c.get(ready).status_code == 200, 60, procs[1])

            answered: dict[str, int] = {"1": 0, "2": 0}
            for i in range(40):
                r = c.post("/v2/models/clf/infer", json=body, headers={"X-User-Id": f"user-{i}"})
                assert r.status_code == 200, r.text
                out = r.json()
                number = out["model_version"]
                got = np.array(out["outputs"][0]["data"], dtype=np.float32).reshape(ROWS, -1)
                # Each arm answers its own graph: the agent runs the stored INT8 artifact.
                np.testing.assert_allclose(got, expected[number], rtol=1e-5, atol=1e-5)
                answered[number] += 1
            assert answered["1"] > 5 and answered["2"] > 5, answered

            def both_arms_counted() -> bool:
                metrics = c.get(f"/api/v1/rollouts/{plan.json()['id']}/metrics").json()
                counts = {arm["version"]: arm["requests"] for arm in metrics["arms"]}
                return counts.get(1, 0) + counts.get(2, 0) == 40 and counts.get(2, 0) > 5

            wait_until(both_arms_counted, 30, interval=0.5)
