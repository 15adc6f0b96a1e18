"""Classic ML end to end: scikit-learn, XGBoost and LightGBM models trained here, converted
with skl2onnx / onnxmltools (their default ZipMap probability outputs included), uploaded
through the API and served by a real agent; labels and probabilities equal the library's own
predict / predict_proba, over OIP JSON, tritonclient (binary) over HTTP and gRPC, and the
prediction API. NaN rows are answered like the library answers them where the version allows
missing values, and refused with a 400 where it does not.

One platform (the embedded backend, uvicorn): the models are what varies here, not the
servers, which the other e2e modules cover."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests import classic_models
from tests.classic_models import Trained

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import create_node, create_tenant, free_port, start_agent, start_server

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-5
ROWS = 24  # within one batch of the default max_batch_size
FEATURES = [f"f{i}" for i in range(classic_models.FEATURES)]


class Platform:
    def __init__(self, url: str, grpc_address: str, key: str, models: dict[str, Trained]):
        self.url, self.grpc_address, self.key, self.models = url, grpc_address, key, models
        self.headers = {"Authorization": f"Bearer {key}"}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=30)


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    models = {
        "logreg": classic_models.logistic_regression(),
        "gboost": classic_models.gradient_boosting(),
        "pipeline": classic_models.scaled_pipeline(),
        "ridge": classic_models.ridge_regressor(),
        "xgb": classic_models.xgboost_classifier(missing=True),
        "lgbm": classic_models.lightgbm_classifier(missing=True),
        # String classes: the label output is a BYTES tensor
        "forest-str": classic_models.random_forest(labels=["cat", "dog", "fox"]),
    }
    backend = make_backend("embedded", tmp_path_factory.mktemp("classic"))
    port, grpc_port = free_port(), free_port()
    server = start_server(backend, "uvicorn", port, grpc_port=grpc_port)
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(backend, url, create_node(backend, "node-1"))
    key = create_tenant(backend, "alpha")
    p = Platform(url, f"127.0.0.1:{grpc_port}", key, models)
    with p.client() as client:
        for name, trained in models.items():
            # The tree models take NaN; "xgb-strict" is the same artifact without it.
            missing = {"allow_missing": "true"} if name in ("xgb", "lgbm") else {}
            features = json.dumps(FEATURES)
            upload_and_promote(client, name, trained.onnx, feature_names=features, **missing)
        upload_and_promote(client, "xgb-strict", models["xgb"].onnx)
        for name in [*models, "xgb-strict"]:
            wait_ready(client, name, proc=agent)
    yield p
    agent.stop()
    server.stop()
    backend.close()


def oip_json(client: httpx.Client, name: str, trained: Trained, x: np.ndarray) -> dict:
    tensor = {
        "name": trained.input_name,
        "datatype": "FP32",
        "shape": list(x.shape),
        "data": x.ravel().tolist(),
    }
    # json.dumps writes NaN as the literal NaN, as tritonclient and most JSON clients do.
    body = json.dumps({"inputs": [tensor]})
    response = client.post(
        f"/v2/models/{name}/infer", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    return {o["name"]: o for o in response.json()["outputs"]}


def assert_like_the_library(trained: Trained, x: np.ndarray, label, probabilities) -> None:
    np.testing.assert_array_equal(np.asarray(label).ravel(), trained.model.predict(x))
    want = trained.model.predict_proba(x)
    got = np.asarray(probabilities, dtype=np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("name", ["logreg", "gboost", "pipeline", "xgb", "lgbm"])
def test_classifiers_answer_like_their_library_with_labels_named(platform, name):
    trained = platform.models[name]
    x = trained.x[:ROWS]
    with platform.client() as client:
        outputs = oip_json(client, name, trained, x)
        meta = client.get(f"/v2/models/{name}").json()
    probabilities = outputs[trained.probability_output]
    assert probabilities["datatype"] == "FP32" and probabilities["shape"] == [ROWS, 3]
    assert_like_the_library(
        trained, x, outputs[trained.label_output]["data"], probabilities["data"]
    )
    classes = trained.model.classes_.tolist()
    if name != "xgb":  # onnxmltools gives XGBoost's probabilities as a plain matrix
        assert probabilities["parameters"]["labels"] == classes
        (declared,) = [o for o in meta["outputs"] if o["name"] == trained.probability_output]
        assert declared["parameters"] == {"labels": classes}


def test_string_class_labels_come_back_as_strings_on_every_door(platform):
    trained = platform.models["forest-str"]
    x = trained.x[:ROWS]
    want = trained.model.predict(x)
    with platform.client() as client:
        outputs = oip_json(client, "forest-str", trained, x)
    label = outputs[trained.label_output]
    assert label["datatype"] == "BYTES" and label["data"] == want.tolist()
    assert outputs[trained.probability_output]["parameters"]["labels"] == ["cat", "dog", "fox"]
    assert_like_the_library(trained, x, label["data"], outputs[trained.probability_output]["data"])
    with triton_http.InferenceServerClient(platform.url.removeprefix("http://")) as client:
        tensor = triton_http.InferInput(trained.input_name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        outputs_wanted = [triton_http.InferRequestedOutput(trained.label_output, binary_data=True)]
        result = client.infer(
            "forest-str", [tensor], outputs=outputs_wanted, headers=dict(platform.headers)
        )
    assert [b.decode() for b in result.as_numpy(trained.label_output).ravel()] == want.tolist()
    with triton_grpc.InferenceServerClient(platform.grpc_address) as client:
        tensor = triton_grpc.InferInput(trained.input_name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        headers = {"authorization": platform.headers["Authorization"]}
        result = client.infer("forest-str", [tensor], headers=headers)
    assert [b.decode() for b in result.as_numpy(trained.label_output).ravel()] == want.tolist()


def test_a_regressor_answers_like_its_library_on_the_prediction_api(platform):
    trained = platform.models["ridge"]
    x = trained.x[:ROWS]
    rows = [dict(zip(FEATURES, map(float, row), strict=True)) for row in x]
    with platform.client() as client:
        response = client.post("/api/v1/models/ridge/predict", json={"instances": rows})
    assert response.status_code == 200, response.text
    got = np.asarray(response.json()["predictions"]).ravel()
    np.testing.assert_allclose(got, trained.model.predict(x), rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("name", ["xgb", "lgbm"])
def test_nan_rows_over_tritonclient_http_and_grpc_match_the_library(platform, name):
    trained = platform.models[name]
    x = trained.x[:ROWS]
    assert np.isnan(x).any()
    for binary in (True, False):  # False: JSON data, where tritonclient writes NaN literals
        with triton_http.InferenceServerClient(platform.url.removeprefix("http://")) as client:
            tensor = triton_http.InferInput(trained.input_name, list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            # a copy: tritonclient adds its own headers to the dict it is given
            result = client.infer(name, [tensor], headers=dict(platform.headers))
        labels, probabilities = result.as_numpy("label"), result.as_numpy("probabilities")
        assert_like_the_library(trained, x, labels, probabilities)
    with triton_grpc.InferenceServerClient(platform.grpc_address) as client:
        tensor = triton_grpc.InferInput(trained.input_name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        headers = {"authorization": platform.headers["Authorization"]}
        result = client.infer(name, [tensor], headers=headers)
        meta = client.get_model_metadata(name, headers=headers, as_json=True)
    assert meta["outputs"][1] == {"name": "probabilities", "datatype": "FP32", "shape": ["-1", "3"]}
    assert_like_the_library(trained, x, result.as_numpy("label"), result.as_numpy("probabilities"))


def test_nan_as_a_json_literal_and_null_features_match_the_library(platform):
    trained = platform.models["lgbm"]
    x = trained.x[:ROWS]
    rows = [
        {f: None if np.isnan(v) else float(v) for f, v in zip(FEATURES, row, strict=True)}
        for row in x
    ]
    with platform.client() as client:
        outputs = oip_json(client, "lgbm", trained, x)
        predicted = client.post("/api/v1/models/lgbm/predict", json={"instances": rows})
    assert_like_the_library(trained, x, outputs["label"]["data"], outputs["probabilities"]["data"])
    assert predicted.status_code == 200, predicted.text
    body = predicted.json()
    assert body["class_labels"] == {"probabilities": [0, 1, 2]}
    assert_like_the_library(trained, x, body["predictions"], body["outputs"]["probabilities"])


def test_nan_is_refused_where_the_version_does_not_allow_missing_values(platform):
    x = platform.models["xgb"].x[:ROWS]
    data = x.ravel().tolist()
    tensor = {"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": data}
    with platform.client() as client:
        response = client.post(
            "/v2/models/xgb-strict/infer",
            content=json.dumps({"inputs": [tensor]}),
            headers={"content-type": "application/json"},
        )
        finite = client.post(
            "/v2/models/xgb-strict/infer",
            json={"inputs": [{**tensor, "data": np.nan_to_num(x).ravel().tolist()}]},
        )
    assert response.status_code == 400
    assert "NaN or infinity" in response.json()["error"]
    assert "allow_missing=true" in response.json()["error"]
    assert finite.status_code == 200, finite.text
    with triton_grpc.InferenceServerClient(platform.grpc_address) as client:
        grpc_tensor = triton_grpc.InferInput("input", list(x.shape), "FP32")
        grpc_tensor.set_data_from_numpy(x)
        headers = {"authorization": platform.headers["Authorization"]}
        with pytest.raises(InferenceServerException, match="NaN or infinity"):
            client.infer("xgb-strict", [grpc_tensor], headers=headers)


def test_infinity_is_refused_even_where_nan_is_allowed(platform):
    x = platform.models["xgb"].x[:2].copy()
    x[0, 0] = np.inf
    with triton_http.InferenceServerClient(platform.url.removeprefix("http://")) as client:
        tensor = triton_http.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="only NaN marks a missing value"):
            client.infer("xgb", [tensor], headers=dict(platform.headers))
