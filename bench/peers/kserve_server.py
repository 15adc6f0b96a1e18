"""KServe's Python model server serving an ONNX file with ONNX Runtime: a peer row of
``bench/oip_bench.py --peers kserve``.

Run in ``bench/.peers-venv`` (``bench/peers_bench.py`` makes it):
``python bench/peers/kserve_server.py --model_path model.onnx --model_name fraud-detector
--http_port 8080``. It speaks OIP v2 REST (``/v2/models/{name}/infer``), so the benchmark sends
it the same body as Switchyard. KServe has no server-side batching in its model server: each
request is one ONNX Runtime call, as in KServe's own custom-model example.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from typing import Any

import kserve
from kserve.errors import InvalidInput
from kserve.model_server import parser as kserve_parser
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument
from peer_oip import DATATYPES, TextEmbedder, onnx_session


class OnnxModel(kserve.Model):
    """One ONNX file, one ONNX Runtime session (one intra-op thread, as Switchyard's agent)."""

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.path = path
        self.load()

    def load(self) -> bool:
        self.session = onnx_session(self.path)
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.ready = True
        return self.ready

    def predict(
        self,
        payload: InferRequest,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> InferResponse:
        feed = {i.name: i.as_numpy() for i in payload.inputs}
        try:
            arrays = self.session.run(self.output_names, feed)
        except (InvalidArgument, Fail, ValueError) as exc:  # names, shapes or dtypes: a 400
            raise InvalidInput(str(exc)) from exc
        return _response(self.name, payload, self.output_names, arrays)


class EmbeddingModel(kserve.Model):
    """A sentence-embedding graph behind its tokenizer (``peer_oip.TextEmbedder``): OIP v2
    requests whose one BYTES input ``text`` holds the strings, one vector per string back."""

    def __init__(self, name: str, path: str, tokenizer: str) -> None:
        super().__init__(name)
        self.embedder = TextEmbedder(path, tokenizer)
        self.ready = True

    def predict(
        self,
        payload: InferRequest,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> InferResponse:
        texts = [t.decode() if isinstance(t, bytes) else str(t) for t in payload.inputs[0].data]
        vectors = self.embedder.embed(texts)
        return _response(self.name, payload, [self.embedder.output], [vectors])


def _response(
    model_name: str, payload: InferRequest, names: list[str], arrays: list[Any]
) -> InferResponse:
    """The OIP v2 answer to ``payload``: one JSON output per name."""
    outputs = []
    for name, array in zip(names, arrays, strict=True):
        out = InferOutput(name, list(array.shape), DATATYPES[array.dtype])
        out.set_data_from_numpy(array, binary_data=False)
        outputs.append(out)
    return InferResponse(
        response_id=payload.id or str(uuid.uuid4()),
        model_name=model_name,
        infer_outputs=outputs,
    )


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(parents=[kserve_parser])
    parser.add_argument("--model_path", required=True)
    parser.add_argument("--tokenizer", help="serve a sentence-embedding graph behind this file")
    args, _ = parser.parse_known_args(argv)
    model: kserve.Model
    if args.tokenizer:
        model = EmbeddingModel(args.model_name, args.model_path, args.tokenizer)
    else:
        model = OnnxModel(args.model_name, args.model_path)
    server = kserve.ModelServer(
        http_port=args.http_port,
        workers=1,
        enable_grpc=False,  # the benchmark speaks REST; a gRPC server would only share the core
        enable_latency_logging=False,
    )
    # One access-log line per request is not part of serving; Switchyard's rows run uvicorn with
    # --no-access-log too. KSERVE_LOGLEVEL=WARNING (set by the bench) quiets KServe's own logs.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    server.start([model])


if __name__ == "__main__":
    main()
