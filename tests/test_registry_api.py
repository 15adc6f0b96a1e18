"""The registry API: upload, signature checks, immutability, aliases, roles and isolation."""

import hashlib
import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from registry.models import ImmutableVersionError, ModelVersion
from tests.factories import make_model, make_version

pytestmark = pytest.mark.backends


def client_with_key(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def upload(client, name, artifact, **fields):
    data = {"artifact": SimpleUploadedFile("m.onnx", artifact)}
    data.update({k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in fields.items()})
    return client.post(f"/api/v1/models/{name}/versions", data, format="multipart")


@pytest.fixture
def api_a(world):
    return client_with_key(world.key_a)


def test_create_model_upload_version_and_point_production(api_a, onnx_bytes):
    assert api_a.post("/api/v1/models", {"name": "clf", "task": "classifier"}).status_code == 201
    response = upload(
        api_a,
        "clf",
        onnx_bytes,
        source_commit="abc123",
        offline_metrics={"auc": 0.91},
        max_batch_size=16,
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["version"] == 1
    assert body["sha256"] == hashlib.sha256(onnx_bytes).hexdigest()
    assert body["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert body["offline_metrics"] == {"auc": 0.91}
    assert upload(api_a, "clf", onnx_bytes).json()["version"] == 2

    moved = api_a.put("/api/v1/models/clf/aliases/production", {"version": 1}, format="json")
    assert moved.status_code == 200 and moved.json()["version"] == 1
    assert api_a.get("/api/v1/models/clf").json()["aliases"] == {"production": 1}


def test_upload_with_a_signature_that_disagrees_with_the_artifact_is_refused(
    world, api_a, onnx_bytes
):
    make_model(world.a, "clf")
    bad = [{"name": "x", "datatype": "FP32", "shape": [-1, 5]}]
    response = upload(api_a, "clf", onnx_bytes, inputs=bad)
    assert response.status_code == 400
    assert "inputs" in response.json()["error"] and "[-1, 5]" in response.json()["error"]
    assert not ModelVersion.objects.exists()


def test_upload_of_a_file_that_is_not_onnx_is_refused(world, api_a):
    make_model(world.a, "clf")
    response = upload(api_a, "clf", b"\x00garbage")
    assert response.status_code == 400
    assert response.json()["error"].startswith("artifact:")


def test_upload_with_a_malformed_json_field_names_it(world, api_a, onnx_bytes):
    make_model(world.a, "clf")
    data = {"artifact": SimpleUploadedFile("m.onnx", onnx_bytes), "offline_metrics": "{nope"}
    response = api_a.post("/api/v1/models/clf/versions", data, format="multipart")
    assert response.status_code == 400 and "offline_metrics" in response.json()["error"]


def test_version_artifact_hash_and_signature_cannot_change(world, api_a, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    for field in ("sha256", "inputs", "artifact"):
        response = api_a.patch("/api/v1/models/clf/versions/1", {field: "x"}, format="json")
        assert response.status_code == 400 and field in response.json()["error"]
    assert api_a.put("/api/v1/models/clf/versions/1", {}, format="json").status_code == 400
    version.sha256 = "0" * 64
    with pytest.raises(ImmutableVersionError):
        version.save()


def test_serving_settings_of_a_version_may_change(world, api_a, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    response = api_a.patch("/api/v1/models/clf/versions/1", {"max_batch_size": 8}, format="json")
    assert response.status_code == 200 and response.json()["max_batch_size"] == 8
    bad = api_a.patch("/api/v1/models/clf/versions/1", {"max_batch_size": 0}, format="json")
    assert bad.status_code == 400 and "max_batch_size" in bad.json()["error"]


def test_other_tenant_gets_404_on_every_registry_endpoint(world, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    other = client_with_key(world.key_b)
    assert other.get("/api/v1/models").json() == []
    for url in (
        "/api/v1/models/clf",
        "/api/v1/models/clf/versions",
        "/api/v1/models/clf/versions/1",
        "/api/v1/models/clf/aliases/production",
    ):
        assert other.get(url).status_code == 404, url
    assert upload(other, "clf", onnx_bytes).status_code == 404
    put = other.put("/api/v1/models/clf/aliases/production", {"version": 1}, format="json")
    assert put.status_code == 404


def test_unknown_and_revoked_keys_get_401(world):
    assert client_with_key("sy_abc_def").get("/api/v1/models").status_code == 401
    assert APIClient().get("/api/v1/models").status_code in (401, 403)


def test_viewer_reads_but_cannot_change(world, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    client = APIClient()
    client.force_login(world.viewer_a)
    assert client.get("/api/v1/models/clf").status_code == 200
    assert client.post("/api/v1/models", {"name": "x", "task": "classifier"}).status_code == 403


def test_engineer_signed_in_can_change(world):
    client = APIClient()
    client.force_login(world.engineer_a)
    assert client.post("/api/v1/models", {"name": "x", "task": "regressor"}).status_code == 201


def test_user_outside_the_tenant_sees_nothing(world, onnx_bytes):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    client = APIClient()
    client.force_login(world.outsider)
    assert client.get("/api/v1/models/clf").status_code == 403


def test_duplicate_model_name_in_one_tenant_is_a_400(world, api_a):
    api_a.post("/api/v1/models", {"name": "clf", "task": "classifier"})
    response = api_a.post("/api/v1/models", {"name": "clf", "task": "classifier"})
    assert response.status_code == 400 and "name" in response.json()["error"]


def test_bad_model_fields_name_the_field(api_a):
    response = api_a.post("/api/v1/models", {"name": "Bad Name!", "task": "magic"})
    assert response.status_code == 400
    assert "name" in response.json()["fields"] and "task" in response.json()["fields"]


def test_openapi_schema_documents_the_prediction_api(api_a):
    response = api_a.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    assert "/api/v1/models/{name}/predict" in response.json()["paths"]


def test_api_docs_page_serves_its_assets_locally(client, db):
    page = client.get("/api/docs/").content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/" in page
    assert "cdn.jsdelivr" not in page


# Monitoring settings and personal fields ------------------------------------------------------


def test_monitoring_settings_of_a_model_change_audited_and_bounded(world, api_a):
    from tenants.models import AuditEvent

    make_model(world.a, "clf")
    changed = api_a.patch(
        "/api/v1/models/clf",
        {"log_sample_rate": 1.0, "log_retention_days": 7, "drift_threshold": 0.25},
        format="json",
    )
    assert changed.status_code == 200, changed.json()
    body = changed.json()
    assert (body["log_sample_rate"], body["log_retention_days"]) == (1.0, 7)
    event = AuditEvent.objects.get(action="model.update")
    assert event.before["log_sample_rate"] == 0.1 and event.after["log_sample_rate"] == 1.0
    too_much = api_a.patch("/api/v1/models/clf", {"log_sample_rate": 1.5}, format="json")
    assert too_much.status_code == 400 and "log_sample_rate" in too_much.json()["error"]
    renamed = api_a.patch("/api/v1/models/clf", {"name": "other"}, format="json")
    assert renamed.status_code == 400 and "name" in renamed.json()["error"]


def test_only_writers_of_the_tenant_change_a_models_settings(world):
    make_model(world.a, "clf")
    viewer = APIClient()
    viewer.force_login(world.viewer_a)
    assert (
        viewer.patch("/api/v1/models/clf", {"log_sample_rate": 0.5}, format="json").status_code
        == 403
    )
    other = client_with_key(world.key_b)
    assert (
        other.patch("/api/v1/models/clf", {"log_sample_rate": 0.5}, format="json").status_code
        == 404
    )


def test_personal_fields_name_inputs_or_features_and_a_rule(world, api_a, onnx_bytes):
    make_model(world.a, "clf")
    features = ["age", "email", "income", "zip"]
    bad_name = upload(
        api_a, "clf", onnx_bytes, feature_names=features, personal_fields={"ssn": "hash"}
    )
    assert bad_name.status_code == 400 and "personal_fields" in bad_name.json()["error"]
    bad_rule = upload(
        api_a, "clf", onnx_bytes, feature_names=features, personal_fields={"email": "hide"}
    )
    assert bad_rule.status_code == 400 and "redact" in bad_rule.json()["error"]
    ok = upload(api_a, "clf", onnx_bytes, feature_names=features, personal_fields={"email": "hash"})
    assert ok.status_code == 201 and ok.json()["personal_fields"] == {"email": "hash"}
    marked = api_a.patch(
        "/api/v1/models/clf/versions/1",
        {"personal_fields": {"email": "hash", "zip": "redact"}},
        format="json",
    )
    assert marked.status_code == 200 and marked.json()["personal_fields"]["zip"] == "redact"
