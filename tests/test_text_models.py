"""ONNX versions that take text: a tokenizer attached at upload (checked, hashed, stored) turns
the graph's token inputs into one BYTES ``text`` input plus a ``token_count`` output; the agent's
``TextRuntime`` tokenizes a batch and gives MiniLM's sentence embeddings equal to
sentence-transformers' in this process."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from platform_site.demo import minilm
from registry.signature import SignatureError
from serving_agent._runtime import load_runtime, warm_up
from serving_agent._text import text_wrapper
from serving_agent.protocol import ARTIFACT_PATH, TensorSpec, VersionSpec
from tests.factories import make_model, make_tenant, make_version
from tests.onnx_models import small_onnx

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Switchyard serves models.",
    "Ein Satz auf Deutsch, mit Umlauten: äöü.",
    "x",
    # Past 256 tokens: truncated where sentence-transformers truncates.
    " ".join(["serving"] * 40 + ["embeddings", "for", "long", "documents"] * 60),
]


@pytest.fixture(scope="session")
def minilm_onnx() -> Path:
    """The export, made once and cached across runs (``platform_site.demo.minilm``)."""
    return minilm.exported()


@pytest.fixture(scope="session")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm.model_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True)


@pytest.mark.django_db
def test_a_tokenizer_makes_the_version_take_text(minilm_onnx: Path) -> None:
    tokenizer = minilm.tokenizer_path().read_bytes()
    model = make_model(make_tenant("alpha"), "minilm", task="embedding")
    version = make_version(model, minilm_onnx.read_bytes(), tokenizer=tokenizer)
    assert version.inputs == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert version.outputs == [
        {"name": "sentence_embedding", "datatype": "FP32", "shape": [-1, 384]},
        {"name": "token_count", "datatype": "INT64", "shape": [-1]},
    ]
    assert version.tokenizer_sha256 == hashlib.sha256(tokenizer).hexdigest()
    assert version.tokenizer.read() == tokenizer


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        (b'{"model": "nothing like a tokenizer"}', "not a valid tokenizer.json"),
        (b"\x80\x04pickle", "pickle files are refused"),
        (b"", "empty"),
    ],
)
def test_a_broken_tokenizer_is_refused_naming_the_field(
    minilm_onnx: Path, tokenizer: bytes, message: str
) -> None:
    model = make_model(make_tenant("alpha"), "minilm", task="embedding")
    with pytest.raises(SignatureError, match=message) as refused:
        make_version(model, minilm_onnx.read_bytes(), tokenizer=tokenizer)
    assert refused.value.field == "tokenizer"


@pytest.mark.django_db
def test_a_graph_that_takes_no_tokens_cannot_have_a_tokenizer() -> None:
    model = make_model(make_tenant("alpha"), "clf")
    with pytest.raises(SignatureError, match=r"this graph takes \['x'\]"):
        make_version(model, small_onnx(), tokenizer=minilm.tokenizer_path().read_bytes())


def text_spec(max_batch_size: int = 8) -> VersionSpec:
    return VersionSpec(
        version_id=1,
        model="minilm",
        version=1,
        sha256="0" * 64,
        artifact_url=ARTIFACT_PATH.format(version_id=1),
        inputs=[TensorSpec(name="text", datatype="BYTES", shape=[-1])],
        outputs=[
            TensorSpec(name="sentence_embedding", datatype="FP32", shape=[-1, 384]),
            TensorSpec(name="token_count", datatype="INT64", shape=[-1]),
        ],
        max_batch_size=max_batch_size,
        tokenizer_url="/t",
        tokenizer_sha256="0" * 64,
    )


def test_the_agent_runtime_matches_sentence_transformers(
    minilm_onnx: Path, reference: np.ndarray
) -> None:
    spec = text_spec()
    runtime = load_runtime(minilm_onnx, spec, wrap=text_wrapper(minilm.tokenizer_path(), spec))
    warm_up(runtime, spec, timed_runs=1)
    texts = np.array([t.encode() for t in TEXTS], dtype=object)
    vectors, counts = runtime.run({"text": texts})
    np.testing.assert_allclose(vectors, reference, atol=1e-4)
    cosine = (vectors * reference).sum(1) / np.linalg.norm(reference, axis=1)
    assert (cosine > 0.999).all()
    # One row alone gives the same vector as in a padded batch.
    alone, _ = runtime.run({"text": texts[1:2]})
    np.testing.assert_allclose(alone[0], vectors[1], atol=1e-5)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm.tokenizer_path()))
    tokenizer.no_padding()  # the file pads to 128; a count is of the real tokens
    assert counts.tolist() == [len(tokenizer.encode(t).ids) for t in TEXTS]


def test_invalid_utf8_is_a_bad_input_naming_the_text_input(minilm_onnx: Path) -> None:
    from serving_agent._exceptions import BadInput

    spec = text_spec()
    runtime = load_runtime(minilm_onnx, spec, wrap=text_wrapper(minilm.tokenizer_path(), spec))
    with pytest.raises(BadInput, match="input 'text': not valid UTF-8"):
        runtime.run({"text": np.array([b"\xff"], dtype=object)})


def test_a_graph_with_a_fixed_sequence_length_gets_exactly_that_many_tokens(tmp_path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["ids"])],
        "fixed",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["batch", 8])],
        [helper.make_tensor_value_info("ids", TensorProto.INT32, ["batch", 8])],
    )
    path = tmp_path / "fixed.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, str(path))
    spec = text_spec().model_copy(
        update={
            "outputs": [
                TensorSpec(name="ids", datatype="INT32", shape=[-1, 8]),
                TensorSpec(name="token_count", datatype="INT64", shape=[-1]),
            ]
        }
    )
    runtime = load_runtime(path, spec, wrap=text_wrapper(minilm.tokenizer_path(), spec))
    texts = np.array([b"hi", b"a much longer sentence than eight tokens allow"], dtype=object)
    ids, counts = runtime.run({"text": texts})
    assert ids.dtype == np.int32 and ids.shape == (2, 8)
    assert counts.tolist() == [3, 8]  # [CLS] hi [SEP], then truncated at the graph's 8
    assert ids[0, 3:].tolist() == [0] * 5  # padded with [PAD] to the fixed length
