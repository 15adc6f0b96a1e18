"""The ``python`` packages the tests upload (tests/packages/*), packed as a client would: the
text classifier's artifacts (a tokenizer trained here in a second, an ONNX graph built from
a seed) made first, into a copy of its folder."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PACKAGES = Path(__file__).parent / "packages"
CORPUS = [
    "the service was great and fast",
    "a terrible slow awful answer",
    "great model great results",
    "awful latency and a slow queue",
    "fast and friendly",
]
LENGTH = 8  # the package's model.LENGTH


def pack(folder: Path, root: str = "") -> bytes:
    """A gzipped tar of ``folder`` (its files under ``root/`` when given)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(folder.rglob("*")):
            if "__pycache__" in path.parts:
                continue
            name = path.relative_to(folder).as_posix()
            archive.add(path, arcname=f"{root}/{name}" if root else name, recursive=False)
    return buffer.getvalue()


def text_scores_graph(vocabulary: int, seed: int = 0) -> bytes:
    """ids [-1, 8] INT64 -> scores [-1, 2]: embeddings averaged, then a linear layer and a
    softmax."""
    rng = np.random.default_rng(seed)
    embeddings = rng.normal(size=(vocabulary, 4)).astype(np.float32)
    weights = rng.normal(size=(4, 2)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["embeddings", "ids"], ["vectors"]),
            helper.make_node("ReduceMean", ["vectors", "axes"], ["mean"], keepdims=0),
            helper.make_node("MatMul", ["mean", "weights"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["scores"], axis=1),
        ],
        "text_scores",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", LENGTH])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", 2])],
        initializer=[
            numpy_helper.from_array(embeddings, "embeddings"),
            numpy_helper.from_array(weights, "weights"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()


def text_scores_package(target: Path) -> Path:
    """tests/packages/text_scores with its artifacts, in ``target`` (returned)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    shutil.copytree(PACKAGES / "text_scores", target, ignore=shutil.ignore_patterns("__py*"))
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    (target / "artifacts").mkdir()
    tokenizer.save(str(target / "artifacts" / "tokenizer.json"))
    graph = text_scores_graph(tokenizer.get_vocab_size())
    (target / "artifacts" / "model.onnx").write_bytes(graph)
    return target


def text_scores_by_hand(package: Path, texts: list[str]) -> np.ndarray:
    """The package's steps run here, without the platform: what its answers must equal."""
    import onnxruntime
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(package / "artifacts" / "tokenizer.json"))
    ids = np.zeros((len(texts), LENGTH), dtype=np.int64)
    for row, encoding in enumerate(tokenizer.encode_batch(texts)):
        ids[row, : len(encoding.ids[:LENGTH])] = encoding.ids[:LENGTH]
    session = onnxruntime.InferenceSession(
        str(package / "artifacts" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"ids": ids})[0]
