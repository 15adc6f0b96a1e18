"""The peer model servers' code in ``bench/peers`` (the benchmark's KServe, TorchServe and
MLServer rows) answers what ONNX Runtime answers, and a bad request gets a 400.

``peer_oip`` (OIP v2 JSON to ONNX Runtime and back, TorchServe's batch) imports no server package
and is tested here in the main venv. The KServe model and the TorchServe handler themselves need
their packages, which live only in ``bench/.peers-venv`` (made by ``bench/peers_bench.py`` at
bench time, never in CI): their tests run there when it exists, and are skipped otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.onnx_models import small_onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "peers"))
sys.path.insert(0, str(ROOT / "bench"))

import peer_oip  # noqa: E402
import peers_bench  # noqa: E402

PEERS_PY = ROOT / "bench" / ".peers-venv" / "bin" / "python"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("peer") / "small.onnx"
    path.write_bytes(small_onnx())  # x: (batch, 4) → y: (batch, 2)
    return path


@pytest.fixture(scope="module")
def session(model_path: Path) -> ort.InferenceSession:
    return peer_oip.onnx_session(str(model_path))


def request(rows: np.ndarray, name: str = "x") -> dict:
    return {
        "inputs": [
            {
                "name": name,
                "shape": list(rows.shape),
                "datatype": "FP32",
                "data": rows.ravel().tolist(),
            }
        ]
    }


def expected(session: ort.InferenceSession, rows: np.ndarray) -> np.ndarray:
    return session.run(["y"], {"x": rows})[0]


def output(answer: dict) -> np.ndarray:
    (out,) = answer["outputs"]
    assert out["name"] == "y" and out["datatype"] == "FP32"
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_a_batch_of_requests_answers_each_as_onnx_runtime_does_alone(session):
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 4)).astype(np.float32) for n in (1, 3, 2)]
    # TorchServe hands the handler a parsed dict for application/json, bytes otherwise.
    bodies = [request(parts[0]), json.dumps(request(parts[1])).encode(), request(parts[2])]

    answers = peer_oip.infer_batch(session, "small", bodies)

    assert [status for status, _ in answers] == [200, 200, 200]
    for (_, answer), rows in zip(answers, parts, strict=True):
        assert answer["model_name"] == "small"
        np.testing.assert_allclose(output(answer), expected(session, rows), rtol=1e-6)


def test_a_bad_request_gets_its_own_400_and_the_rest_of_its_batch_is_served(session):
    good = np.ones((1, 4), np.float32)
    too_wide = request(np.ones((1, 5), np.float32))  # valid JSON the model rejects
    bodies = [request(good), b"not json", too_wide, {"inputs": []}, request(good)]

    answers = peer_oip.infer_batch(session, "small", bodies)

    assert [status for status, _ in answers] == [200, 400, 400, 400, 200]
    assert "not JSON" in answers[1][1]["error"]
    assert "Got invalid dimensions" in answers[2][1]["error"]
    for i in (0, 4):
        np.testing.assert_allclose(output(answers[i][1]), expected(session, good), rtol=1e-6)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"inputs": "x"}, "non-empty 'inputs' list"),
        ([1, 2], "non-empty 'inputs' list"),
        ({"inputs": [3]}, "each input must be an object"),
        (
            {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP16", "data": [0] * 4}]},
            "datatype",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1, -4], "datatype": "FP32", "data": [0] * 4}]},
            "shape",
        ),
        (
            {"inputs": [{"name": "x", "shape": [True, 4], "datatype": "FP32", "data": [0] * 4}]},
            "shape",
        ),
        ({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 3}]}, "fill"),
        (
            {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": ["a"]}]},
            "not FP32",
        ),
    ],
)
def test_hostile_bodies_are_refused_with_a_reason(body, message):
    with pytest.raises(peer_oip.BadRequest, match=message):
        peer_oip.decode_request(body)


def test_requests_with_different_inputs_are_not_stacked():
    with pytest.raises(peer_oip.BadRequest, match="differ"):
        peer_oip.stack([{"x": np.zeros((1, 4))}, {"z": np.zeros((1, 4))}])


def test_split_refuses_outputs_that_do_not_match_the_rows_one_to_one():
    with pytest.raises(ValueError, match="3 rows for 4 inputs"):
        peer_oip.split([np.zeros((3, 2))], [1, 3])


def test_torchserve_batches_32_requests_or_5_ms_with_one_worker_on_loopback(tmp_path):
    config = peers_bench.torchserve_config(tmp_path, (8001, 8002, 8003))
    lines = dict(line.split("=", 1) for line in config.splitlines())

    (model,) = json.loads(lines["models"])["fraud-detector"].values()
    assert (model["batchSize"], model["maxBatchDelay"]) == (32, 5)
    assert (model["minWorkers"], model["maxWorkers"]) == (1, 1)
    for key, port in (("inference", 8001), ("management", 8002), ("metrics", 8003)):
        assert lines[f"{key}_address"] == f"http://127.0.0.1:{port}"
    assert lines["disable_system_metrics"] == "true"
    assert lines["disable_token_authorization"] == "true"


def run_in_peers_venv(code: str, model_path: Path) -> object:
    if not PEERS_PY.exists():
        pytest.skip("bench/.peers-venv is made at bench time (bench/peers_bench.py --setup)")
    done = subprocess.run(
        [str(PEERS_PY), "-c", code, str(model_path)],
        cwd=ROOT / "bench" / "peers",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


KSERVE = """
import json, sys
path, sys.argv = sys.argv[1], sys.argv[:1]  # KServe's model server parses sys.argv at import
import numpy as np
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferInput, InferRequest
from kserve_server import OnnxModel

model = OnnxModel("small", path)
rows = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
good = InferInput("x", [3, 4], "FP32", rows.ravel().tolist())
response = model.predict(InferRequest("small", [good]))
try:
    model.predict(InferRequest("small", [InferInput("x", [1, 5], "FP32", [0.0] * 5)]))
    refused = False
except InvalidInput:
    refused = True
print(json.dumps({"response": response.to_rest()[0], "refused": refused}))
"""


def test_the_kserve_model_answers_as_onnx_runtime_and_refuses_a_bad_shape(model_path, session):
    result = run_in_peers_venv(KSERVE, model_path)

    assert result["refused"] is True
    rows = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    np.testing.assert_allclose(output(result["response"]), expected(session, rows), rtol=1e-6)


TORCHSERVE = """
import json, os, shutil, sys, tempfile
import ts
from ts.context import Context, RequestProcessor
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from torchserve_handler import OnnxOipHandler

model_dir = tempfile.mkdtemp()
shutil.copy(sys.argv[1], os.path.join(model_dir, "small.onnx"))
config = os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml")
metrics = MetricsCacheYamlImpl(config)
metrics.initialize_cache()
manifest = {"model": {"modelName": "small", "serializedFile": "small.onnx"}}
context = Context("small", model_dir, manifest, 32, None, "0.12.0", metrics=metrics)
handler = OnnxOipHandler()
handler.initialize(context)
rows = [[[0.1, 0.2, 0.3, 0.4]], [[1.0, 2.0, 3.0, 4.0], [-1.0, 0.0, 1.0, 2.0]]]
bodies = [
    {"inputs": [{"name": "x", "shape": [len(r), 4], "datatype": "FP32", "data": sum(r, [])}]}
    for r in rows
]
bodies.insert(1, b"{}")
context.request_processor = [RequestProcessor({}) for _ in bodies]
answers = handler.handle([{"body": b} for b in bodies], context)
statuses = [p.get_response_status_code() for p in context.request_processor]
print(json.dumps({"answers": answers, "statuses": statuses}))
"""


def test_the_torchserve_handler_serves_a_batch_as_onnx_runtime_with_a_400_for_a_bad_one(
    model_path, session
):
    result = run_in_peers_venv(TORCHSERVE, model_path)

    assert result["statuses"] == [200, 400, 200]
    answers = result["answers"]
    assert "inputs" in answers[1]["error"]
    first = np.array([[0.1, 0.2, 0.3, 0.4]], np.float32)
    second = np.array([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.0, 1.0, 2.0]], np.float32)
    np.testing.assert_allclose(output(answers[0]), expected(session, first), rtol=1e-6)
    np.testing.assert_allclose(output(answers[2]), expected(session, second), rtol=1e-6)


def _summing_embedder(tmp_path: Path) -> peer_oip.TextEmbedder:
    """A tokenizer of four words and a graph whose "embedding" of a text is the sum of its
    token ids under the attention mask: padding to a batch's longest must not change it."""
    import onnx
    from onnx import TensorProto, helper
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 4, "d": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n", "l"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["n", "l"])
    out = helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["n", 1])
    nodes = [
        helper.make_node("Mul", ["input_ids", "attention_mask"], ["kept"]),
        helper.make_node("Cast", ["kept"], ["kept_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["kept_f", "axis"], ["sentence_embedding"], keepdims=1),
    ]
    axis = helper.make_tensor("axis", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(nodes, "sum", [ids, mask], [out], initializer=[axis])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "model.onnx"))
    return peer_oip.TextEmbedder(str(tmp_path / "model.onnx"), str(tmp_path / "tokenizer.json"))


def text_request(texts: list[str]) -> dict:
    return {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]}


def test_an_embedding_batch_answers_each_request_its_own_rows_and_a_bad_one_a_400(
    tmp_path: Path,
) -> None:
    embedder = _summing_embedder(tmp_path)
    bodies = [text_request(["a b"]), {"inputs": [{"name": "x"}]}, text_request(["c", "d d a"])]
    answers = peer_oip.embed_batch(embedder, "m", [json.dumps(b) for b in bodies])
    assert [status for status, _ in answers] == [200, 400, 200]
    assert "'text'" in answers[1][1]["error"]
    assert answers[0][1]["outputs"][0]["data"] == [5.0]  # a + b = 2 + 3
    assert answers[2][1]["outputs"][0] == {
        "name": "sentence_embedding",
        "shape": [2, 1],
        "datatype": "FP32",
        "data": [4.0, 12.0],  # c; d + d + a, its padding masked out
    }
