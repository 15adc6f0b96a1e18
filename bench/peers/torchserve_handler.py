"""A TorchServe handler serving an ONNX file with ONNX Runtime: a peer row of
``bench/oip_bench.py --peers torchserve``.

``bench/peers_bench.py`` packs it with ``torch-model-archiver`` (the ONNX file as the serialized
file, ``peer_oip.py`` as an extra file) and runs TorchServe with server-side batching (32 requests
or 5 ms, whichever comes first) and one worker. A request's body is the same OIP v2 JSON that
Switchyard takes, posted to ``/predictions/{name}``; the answer is OIP v2 JSON too. TorchServe
hands the handler a list of requests (its batch): they run as one ONNX Runtime call.
"""

from __future__ import annotations

import os
from typing import Any

from peer_oip import TextEmbedder, embed_batch, infer_batch, onnx_session
from ts.context import Context
from ts.torch_handler.base_handler import BaseHandler


class OnnxOipHandler(BaseHandler):
    """TorchServe finds the handler as the one class this module defines."""

    embedder: TextEmbedder | None = None

    def initialize(self, context: Context) -> None:
        model = context.manifest["model"]
        model_dir = context.system_properties["model_dir"]
        path = os.path.join(model_dir, model["serializedFile"])
        tokenizer = os.path.join(model_dir, "tokenizer.json")
        if os.path.exists(tokenizer):  # a sentence-embedding graph, packed with its tokenizer
            self.embedder = TextEmbedder(path, tokenizer)
        else:
            self.session = onnx_session(path)  # one intra-op thread, as Switchyard's agent
        self.model_name = model["modelName"]
        self.initialized = True

    def preprocess(self, data: list[dict[str, Any]]) -> list[Any]:
        # TorchServe has already parsed a JSON body into a dict (its "body", or "data" for a form).
        return [row.get("body", row.get("data")) for row in data]

    def inference(self, data: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        if self.embedder is not None:
            return embed_batch(self.embedder, self.model_name, data)
        return infer_batch(self.session, self.model_name, data)

    def postprocess(self, data: list[Any]) -> list[Any]:
        for idx, (status, _) in enumerate(data):
            if status != 200:
                self.context.set_response_status(status, "Bad Request", idx)
        return [answer for _, answer in data]
