"""MLflow import against a real MLflow tracking server (SQLite backend) started once per module."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from registry.models import ModelVersion
from rollouts.models import ApprovalRequest
from tenants.models import AuditEvent
from tests.factories import key_client, make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    mlflow_bin = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.Popen(
        [
            mlflow_bin,
            "server",
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{uri}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("mlflow server did not start")
        yield uri
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # a loaded machine: its workers were slow to go
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def logged(mlflow_server):
    """An ONNX model and a sklearn-flavoured one, registered, the ONNX one aliased champion."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_registry_uri(mlflow_server)
    artifact = small_onnx(seed=5)
    with mlflow.start_run() as run:
        mlflow.log_metric("accuracy", 0.93)
        mlflow.log_param("depth", "3")
        mlflow.onnx.log_model(
            onnx.load_from_string(artifact), name="model", registered_model_name="fraud"
        )
    client = MlflowClient(mlflow_server)
    client.set_registered_model_alias("fraud", "champion", "1")
    # A flavour the runtimes cannot serve: an MLmodel naming only sklearn.
    with mlflow.start_run():
        mlflow.log_text("flavors:\n  sklearn: {pickled_model: model.pkl}\n", "skl/MLmodel")
        mlflow.log_text("not a pickle", "skl/model.pkl")
        skl_run = mlflow.active_run().info.run_id
    client.create_registered_model("pickled")
    client.create_model_version("pickled", f"runs:/{skl_run}/skl", run_id=skl_run)
    return {"uri": mlflow_server, "artifact": artifact, "run_id": run.info.run_id}


@pytest.fixture(autouse=True)
def loopback_allowed(settings):
    """The test's tracking server listens on the loopback: allow that host for these tests."""
    settings.SWITCHYARD_MLFLOW_ALLOWED_HOSTS = ["127.0.0.1"]


def _import(key, uri, **body):
    return key_client(key).post(
        "/api/v1/models/clf/versions/import", {"tracking_uri": uri, **body}, format="json"
    )


def test_import_by_alias_keeps_lineage_maps_alias_and_predicts_the_same(world, logged):
    make_model(world.a, "clf")
    response = _import(world.key_a, logged["uri"], source="models:/fraud@champion")
    assert response.status_code == 201, response.json()
    assert response.json()["alias"] == {"name": "champion", "version": 1}
    version = ModelVersion.objects.get(model__name="clf", version=1)
    lineage = version.lineage["mlflow"]
    assert (lineage["name"], lineage["version"], lineage["alias"]) == ("fraud", "1", "champion")
    assert lineage["run_id"] == logged["run_id"]
    assert lineage["metrics"] == {"accuracy": 0.93} and lineage["params"] == {"depth": "3"}
    assert lineage["signature"] is None or isinstance(lineage["signature"], dict)
    assert version.offline_metrics == {"accuracy": 0.93}
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    want = ort.InferenceSession(logged["artifact"]).run(None, {"x": x})
    with version.artifact.open("rb") as fh:
        got = ort.InferenceSession(fh.read()).run(None, {"x": x})
    np.testing.assert_allclose(got[0], want[0])
    assert AuditEvent.objects.filter(action="version.create", tenant=world.a).exists()
    # The same MLflow version twice: 409 naming the existing version.
    again = _import(world.key_a, logged["uri"], source="models:/fraud/1")
    assert again.status_code == 409 and "version 1" in str(again.json())


def test_protected_alias_becomes_an_approval_request(world, logged):
    model = make_model(world.a, "clf")
    make_version(model, small_onnx(seed=1))  # production exists: moving it needs approval
    response = _import(world.key_a, logged["uri"], source="models:/fraud/1", alias="production")
    assert response.status_code == 201, response.json()
    assert "approval" in response.json()
    assert ApprovalRequest.objects.filter(model=model).count() == 1
    assert model.aliases.get(name="production").version.version == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"source": "runs:/abc/model"}, "source"),
        ({"source": "models:/nope/1"}, "source"),
        ({"source": "models:/pickled/1"}, "sklearn"),
        ({"source": "models:/fraud/1", "tracking_uri": "file:///etc"}, "tracking_uri"),
    ],
)
def test_bad_sources_are_400(world, logged, body, field):
    make_model(world.a, "clf")
    response = _import(world.key_a, logged["uri"], **body)
    assert response.status_code == 400, response.json()
    assert field in str(response.json())
    assert not ModelVersion.objects.exists()


def test_another_tenant_gets_404(world, logged):
    make_model(world.a, "clf")
    response = _import(world.key_b, logged["uri"], source="models:/fraud/1")
    assert response.status_code == 404


def test_only_the_configured_server_or_allowed_hosts_may_be_named(world, logged, settings):
    make_model(world.a, "clf")
    settings.SWITCHYARD_MLFLOW_ALLOWED_HOSTS = []
    settings.SWITCHYARD_MLFLOW_TRACKING_URI = logged["uri"]
    # Named by a request, any other host is refused before the platform connects to it.
    for uri in ("http://169.254.169.254/latest", "http://localhost:5000", "http://10.0.0.1:9"):
        refused = _import(world.key_a, uri, source="models:/fraud/1")
        assert refused.status_code == 400, refused.json()
        assert "is not an allowed MLflow tracking server" in str(refused.json())
    bad_port = _import(world.key_a, "http://127.0.0.1:99999999", source="models:/fraud/1")
    assert bad_port.status_code == 400 and "tracking_uri" in str(bad_port.json())
    assert not ModelVersion.objects.exists()
    # Without tracking_uri the configured server is used; naming it explicitly is allowed too.
    response = key_client(world.key_a).post(
        "/api/v1/models/clf/versions/import", {"source": "models:/fraud/1"}, format="json"
    )
    assert response.status_code == 201, response.json()
    again = _import(world.key_a, logged["uri"], source="models:/fraud/1")
    assert again.status_code == 409  # allowed, and the same MLflow version: already imported


def test_without_the_mlflow_extra_the_import_answers_503_naming_it(world, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # as if it were not installed
    make_model(world.a, "clf")
    response = _import(world.key_a, "http://127.0.0.1:5000", source="models:/fraud/1")
    assert response.status_code == 503, response.json()
    assert "switchyard[mlflow]" in str(response.json())
