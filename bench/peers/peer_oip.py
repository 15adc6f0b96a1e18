"""OIP v2 JSON to ONNX Runtime and back, for the peer model servers' handlers in this folder.

It imports no server package (KServe, TorchServe, MLServer), so the main venv's tests check it
against ONNX Runtime, and each peer's handler stays a thin adapter around it. The peers run this
code in their own venvs (``bench/.peers-venv``); TorchServe gets it inside the .mar.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument

# The OIP v2 datatypes the benchmark's models use, and back.
DTYPES: dict[str, type[np.generic]] = {
    "FP32": np.float32,
    "FP64": np.float64,
    "INT32": np.int32,
    "INT64": np.int64,
    "BOOL": np.bool_,
}
DATATYPES = {np.dtype(t): name for name, t in DTYPES.items()}


class BadRequest(ValueError):
    """The body is not an OIP v2 inference request this model can take (a 400, not a 500)."""


def onnx_session(path: str, threads: int = 1) -> ort.InferenceSession:
    """The same session options as Switchyard's agent in the benchmark: one intra-op thread,
    one inter-op thread, CPU."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def decode_request(body: bytes | bytearray | str | dict[str, Any]) -> dict[str, np.ndarray]:
    """An OIP v2 JSON request's ``inputs`` as arrays by name, each checked against its shape."""
    if isinstance(body, (bytes, bytearray, str)):
        try:
            body = json.loads(body)
        except ValueError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise BadRequest("body must be an object with a non-empty 'inputs' list")
    feed: dict[str, np.ndarray] = {}
    for item in body["inputs"]:
        if not isinstance(item, dict):
            raise BadRequest("each input must be an object")
        name, shape, datatype = item.get("name"), item.get("shape"), item.get("datatype")
        if not isinstance(name, str) or datatype not in DTYPES:
            raise BadRequest(f"input needs a name and a datatype in {sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise BadRequest(f"input {name!r}: shape must be a list of non-negative integers")
        try:
            array = np.asarray(item.get("data"), dtype=DTYPES[datatype])
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"input {name!r}: data is not {datatype}: {exc}") from exc
        if array.size != int(np.prod(shape)):
            raise BadRequest(f"input {name!r}: {array.size} values do not fill shape {shape}")
        feed[name] = array.reshape(shape)
    return feed


def encode_response(
    model_name: str, names: Sequence[str], arrays: Iterable[np.ndarray]
) -> dict[str, Any]:
    """An OIP v2 JSON response with one output per name."""
    outputs = []
    for name, array in zip(names, arrays, strict=True):
        outputs.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": DATATYPES[array.dtype],
                "data": array.ravel().tolist(),
            }
        )
    return {"model_name": model_name, "outputs": outputs}


def stack(feeds: Sequence[dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], list[int]]:
    """Requests' feeds as one batch along the first axis, and the rows each request brought.

    Every feed must have the same input names (a server-side batch mixes requests)."""
    names = list(feeds[0])
    for feed in feeds[1:]:
        if list(feed) != names:
            raise BadRequest(f"inputs {sorted(feed)} differ from the batch's {sorted(names)}")
    rows = [len(feed[names[0]]) if feed[names[0]].ndim else 1 for feed in feeds]
    if len(feeds) == 1:
        return feeds[0], rows
    return {n: np.concatenate([f[n] for f in feeds]) for n in names}, rows


def split(outputs: Sequence[np.ndarray], rows: Sequence[int]) -> list[list[np.ndarray]]:
    """A batch's outputs cut back into each request's rows, in order."""
    total = sum(rows)
    for out in outputs:
        if len(out) != total:
            raise ValueError(f"the model returned {len(out)} rows for {total} inputs")
    bounds = np.cumsum(rows)[:-1]
    per_output = [np.split(out, bounds) for out in outputs]
    return [list(parts) for parts in zip(*per_output, strict=True)]


def infer_batch(
    session: ort.InferenceSession, model_name: str, bodies: Sequence[Any]
) -> list[tuple[int, dict[str, Any]]]:
    """(HTTP status, OIP v2 JSON) for each request of a server-side batch: the good requests
    run as one ONNX Runtime call, a bad one gets its own 400 without failing the others."""
    names = [o.name for o in session.get_outputs()]
    answers: list[tuple[int, dict[str, Any]] | None] = [None] * len(bodies)
    good: list[int] = []
    feeds: list[dict[str, np.ndarray]] = []
    for i, body in enumerate(bodies):
        try:
            feeds.append(decode_request(body))
            good.append(i)
        except BadRequest as exc:
            answers[i] = (400, {"error": str(exc)})
    if feeds:
        try:
            feed, rows = stack(feeds)
            parts = split(session.run(names, feed), rows)
        except (BadRequest, ValueError, InvalidArgument, Fail) as exc:
            # One call for the whole batch, so a request the model rejects fails its batch: run
            # them one by one to pin the 400 on the request that caused it.
            if len(feeds) == 1:
                answers[good[0]] = (400, {"error": str(exc)})
            else:
                for i, body in zip(good, (bodies[i] for i in good), strict=True):
                    answers[i] = infer_batch(session, model_name, [body])[0]
        else:
            for i, arrays in zip(good, parts, strict=True):
                answers[i] = (200, encode_response(model_name, names, arrays))
    return [a for a in answers if a is not None]


class TextEmbedder:
    """A sentence-embedding ONNX graph behind its tokenizer (the demo's MiniLM export, whose
    graph pools and normalizes): texts in, one vector per text out, padded to the batch's
    longest as Switchyard's agent pads. ``tokenizers`` is imported here only, so the MLP peers
    need nothing more than ONNX Runtime."""

    INPUT = "text"

    def __init__(self, model_path: str, tokenizer_path: str) -> None:
        from tokenizers import Tokenizer

        self.session = onnx_session(model_path)
        self.output = self.session.get_outputs()[0].name
        self.graph_inputs = [i.name for i in self.session.get_inputs()]
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.tokenizer.enable_padding()

    def embed(self, texts: list[str]) -> np.ndarray:
        encoded = self.tokenizer.encode_batch(texts)
        columns = {
            "input_ids": [e.ids for e in encoded],
            "attention_mask": [e.attention_mask for e in encoded],
            "token_type_ids": [e.type_ids for e in encoded],
        }
        feed = {name: np.array(columns[name], np.int64) for name in self.graph_inputs}
        return self.session.run([self.output], feed)[0]


def texts_of(body: bytes | bytearray | str | dict[str, Any]) -> list[str]:
    """The strings of an OIP v2 request's one BYTES input ``text`` (JSON data)."""
    if isinstance(body, (bytes, bytearray, str)):
        try:
            body = json.loads(body)
        except ValueError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from exc
    inputs = body.get("inputs") if isinstance(body, dict) else None
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise BadRequest("body must be an object with one input, 'text'")
    item = inputs[0]
    data = item.get("data")
    if item.get("name") != TextEmbedder.INPUT or item.get("datatype") != "BYTES":
        raise BadRequest("the input must be 'text', datatype BYTES")
    if not isinstance(data, list) or not data or not all(isinstance(t, str) for t in data):
        raise BadRequest("'text' data must be a non-empty list of strings")
    return data


def embed_batch(
    embedder: TextEmbedder, model_name: str, bodies: Sequence[Any]
) -> list[tuple[int, dict[str, Any]]]:
    """``infer_batch`` for a ``TextEmbedder``: every good request's texts in one call."""
    answers: list[tuple[int, dict[str, Any]] | None] = [None] * len(bodies)
    good: list[tuple[int, list[str]]] = []
    for i, body in enumerate(bodies):
        try:
            good.append((i, texts_of(body)))
        except BadRequest as exc:
            answers[i] = (400, {"error": str(exc)})
    if good:
        vectors = embedder.embed([t for _, texts in good for t in texts])
        start = 0
        for i, texts in good:
            part = vectors[start : start + len(texts)]
            start += len(texts)
            answers[i] = (200, encode_response(model_name, [embedder.output], [part]))
    return [a for a in answers if a is not None]
