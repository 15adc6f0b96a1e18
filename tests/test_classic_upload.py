"""Uploading a converted classifier through the API: the ZipMap output is recorded as a
probability matrix with its class labels, allow_missing is set at upload and fixed with the
artifact, and both travel to the agent (VersionSpec) and the gateway (its route)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from rest_framework.test import APIClient

from fleet.assignments import version_spec
from gateway.oip_codec import render_infer
from gateway.routes import route_of
from registry.models import ModelVersion
from tests import classic_models


@pytest.fixture(scope="module")
def forest() -> classic_models.Trained:
    return classic_models.random_forest()


@pytest.fixture
def api(world) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {world.key_a}")
    assert client.post("/api/v1/models", {"name": "trees", "task": "classifier"}).status_code == 201
    return client


def upload(client: APIClient, artifact: bytes, **fields):
    data = {"artifact": SimpleUploadedFile("m.onnx", artifact)}
    data.update({k: json.dumps(v) if isinstance(v, list) else v for k, v in fields.items()})
    return client.post("/api/v1/models/trees/versions", data, format="multipart")


PROBABILITIES = {
    "name": "output_probability",
    "datatype": "FP32",
    "shape": [-1, 3],
    "parameters": {"labels": [0, 1, 2]},
}


def test_a_converted_classifier_uploads_with_its_labels(api, forest):
    response = upload(api, forest.onnx)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["outputs"] == [
        {"name": "output_label", "datatype": "INT64", "shape": [-1]},
        PROBABILITIES,
    ]
    assert body["allow_missing"] is False


def test_a_declared_signature_keeps_the_labels(api, forest):
    declared = [
        {"name": "output_label", "datatype": "INT64", "shape": [-1]},
        {"name": "output_probability", "datatype": "FP32", "shape": [-1, 3]},
    ]
    response = upload(api, forest.onnx, outputs=declared)
    assert response.status_code == 201, response.json()
    assert response.json()["outputs"][1] == PROBABILITIES


def test_a_declared_signature_with_the_wrong_class_count_is_refused(api, forest):
    declared = [
        {"name": "output_label", "datatype": "INT64", "shape": [-1]},
        {"name": "output_probability", "datatype": "FP32", "shape": [-1, 4]},
    ]
    response = upload(api, forest.onnx, outputs=declared)
    assert response.status_code == 400
    assert "declared with shape [-1, 4]" in json.dumps(response.json())


def test_allow_missing_travels_to_the_agent_and_the_gateway(api, forest):
    response = upload(api, forest.onnx, allow_missing="true")
    assert response.status_code == 201, response.json()
    assert response.json()["allow_missing"] is True
    version = ModelVersion.objects.get(model__name="trees", version=response.json()["version"])
    spec = version_spec(version)
    assert spec.allow_missing is True
    assert spec.outputs[1].parameters is not None
    assert spec.outputs[1].parameters.labels == [0, 1, 2]
    assert all(i.allow_missing for i in route_of(version).inputs)


def test_allow_missing_is_fixed_with_the_artifact(api, forest):
    number = upload(api, forest.onnx).json()["version"]
    response = api.patch(f"/api/v1/models/trees/versions/{number}", {"allow_missing": True})
    version = ModelVersion.objects.get(model__name="trees", version=number)
    assert version.allow_missing is False, response.status_code


def test_the_oip_reply_names_the_class_of_each_column(api, forest):
    version = ModelVersion.objects.get(
        model__name="trees", version=upload(api, forest.onnx).json()["version"]
    )
    outputs = [
        ("output_label", np.array([2], np.int64)),
        ("output_probability", np.array([[0.1, 0.2, 0.7]], np.float32)),
    ]
    body, headers = render_infer(route_of(version), None, outputs, {"output_probability"})
    head = json.loads(body[: int(dict(headers)["inference-header-content-length"])])
    assert head["outputs"][1]["parameters"] == {"labels": [0, 1, 2], "binary_data_size": 12}
    assert "parameters" not in head["outputs"][0]


def test_the_model_page_shows_the_classes_and_that_nan_is_allowed(world, api, forest):
    assert upload(api, forest.onnx, allow_missing="true").status_code == 201
    page = Client()
    page.force_login(world.engineer_a)
    content = page.get("/models/trees/").content.decode()
    assert "classes 0, 1, 2" in content
    assert "missing values: NaN allowed" in content
    assert 'name="allow_missing" value="true"' in content  # the upload form sets it too
