"""INT8 variants (registry.quantize): made from an ONNX version as its model's next version,
measured against the original, answering like it within quantisation error, and canaried like
any other version; refused for other formats, other tenants and callers who may not deploy."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from registry.models import ModelVersion
from registry.reference import set_reference_upload
from tenants.audit import SYSTEM
from tenants.models import AuditEvent
from tests.factories import as_user, key_client, make_key, make_model, make_version
from tests.onnx_models import slow_onnx, small_onnx

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}


def _quantize(client, name: str = "clf", version: int = 1):
    return client.post(f"/api/v1/models/{name}/versions/{version}/quantize", format="json")


def _run(version: ModelVersion, x: np.ndarray) -> np.ndarray:
    with version.artifact.open("rb") as fh:
        session = ort.InferenceSession(fh.read(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_a_quantised_variant_is_made_measured_and_answers_like_its_parent(world):
    model = make_model(world.a, "clf")
    original = make_version(model, slow_onnx(width=256, depth=4))
    response = _quantize(key_client(world.key_a))
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["version"], body["parent"], body["format"]) == (2, 1, "onnx")
    report = body["lineage"]["quantized"]
    assert report["from_version"] == 1 and report["sample"].startswith("seeded random")
    assert report["bytes"]["int8"] < report["bytes"]["original"] / 2  # INT8 weights
    assert report["speedup"] > 0 and report["ms_per_run"]["int8"] > 0
    (output,) = report["outputs"].values()
    assert 0 < output["max_abs_diff"] < 0.5 and 0 <= output["argmax_agreement"] <= 1

    variant = ModelVersion.objects.get(model=model, version=2)
    assert variant.sha256 != original.sha256
    assert (variant.inputs, variant.outputs) == (original.inputs, original.outputs)
    # Its answers, run in the test, are the original's within what the report measured.
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    diff = np.abs(_run(variant, x) - _run(original, x))
    assert 0 < diff.max() < 0.5
    event = AuditEvent.objects.get(action="version.create", target__contains="v2")
    assert event.after["parent"] == 1

    # The model page shows what was measured, and offers a variant only where one makes sense.
    page = as_user(world.engineer_a).get("/models/clf/").content.decode()
    assert "INT8 of v1" in page and 'data-quantize="1"' in page
    assert 'data-quantize="2"' not in page  # the variant itself
    assert 'data-quantize="1"' not in as_user(world.viewer_a).get("/models/clf/").content.decode()

    # Canaried like any other version: a plan with the variant as candidate starts.
    plan = key_client(world.key_a).post(
        "/api/v1/models/clf/rollouts",
        {"mode": "canary", "candidate": 2, "weight": 5, "guardrails": GUARDRAILS},
        format="json",
    )
    assert plan.status_code == 201, plan.json()
    assert (plan.json()["baseline"], plan.json()["candidate"]) == (1, 2)


def test_the_drift_reference_is_the_sample_when_it_fits(world):
    model = make_model(world.a, "clf")
    version = make_version(model, small_onnx(), feature_names=["a", "b", "c", "d"])
    rng = np.random.default_rng(3)
    columns = {n: rng.standard_normal(40).round(4).tolist() for n in "abcd"}
    set_reference_upload(version, SYSTEM, columns=columns)
    response = _quantize(key_client(world.key_a))
    assert response.status_code == 201, response.json()
    report = response.json()["lineage"]["quantized"]
    assert report["sample"] == "the version's drift reference" and report["sample_rows"] == 40


def test_refusals(world):
    model = make_model(world.a, "clf")
    make_version(model, small_onnx())
    # Another tenant's model does not exist for them; a viewer and a predict-only key may
    # not make versions; a version that does not exist is a 404.
    assert _quantize(key_client(world.key_b)).status_code == 404
    assert _quantize(as_user(world.viewer_a)).status_code == 403
    predict_only = make_key(world.a, "app", scopes=("predict",))[1]
    assert _quantize(key_client(predict_only)).status_code == 403
    assert _quantize(key_client(world.key_a), version=9).status_code == 404
    assert ModelVersion.objects.count() == 1


def test_only_onnx_versions_are_quantised(world):
    from tests.torch_models import mlp

    model = make_model(world.a, "torchy")
    make_version(model, mlp()[1], format="torch")
    response = _quantize(key_client(world.key_a), name="torchy")
    assert response.status_code == 400
    assert "only ONNX versions" in response.json()["error"]
