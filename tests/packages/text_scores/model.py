"""Scores short texts: tokenized with the package's own tokenizer, run through its ONNX graph."""

import numpy as np
import onnxruntime
from tokenizers import Tokenizer

from switchyard_client.model import InvalidInput

LENGTH = 8  # token ids per text: longer texts are cut, shorter ones padded with 0
LABELS = np.array([b"negative", b"positive"], dtype=object)


class TextScores:
    def load(self):
        # Paths are relative to the package's folder, the worker's working directory.
        self.tokenizer = Tokenizer.from_file("artifacts/tokenizer.json")
        self.session = onnxruntime.InferenceSession(
            "artifacts/model.onnx", providers=["CPUExecutionProvider"]
        )

    def preprocess(self, batch):
        texts = []
        for raw in batch["text"]:
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise InvalidInput("text must be UTF-8") from None
        ids = np.zeros((len(texts), LENGTH), dtype=np.int64)
        for row, encoding in enumerate(self.tokenizer.encode_batch(texts)):
            kept = encoding.ids[:LENGTH]
            ids[row, : len(kept)] = kept
        return ids

    def predict(self, ids):
        (scores,) = self.session.run(None, {"ids": ids})
        return scores

    def postprocess(self, scores):
        return {"scores": scores, "label": LABELS[scores.argmax(axis=1)]}
