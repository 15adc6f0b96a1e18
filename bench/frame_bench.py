"""Is the binary tensor framing between gateway and agent worth it over JSON?

Times one hop's serialisation work for a request and its reply, both ways (encode on one side,
decode on the other), for the binary frames of ``serving_agent.protocol`` and for the same
messages as JSON (orjson) with tensors as nested lists. Prints a table of microseconds.
Run: ``.venv/bin/python bench/frame_bench.py``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving_agent.protocol import (  # noqa: E402
    InferRequest,
    InferResult,
    decode_frame,
    encode_frame,
    tensor_of,
)


def binary_round(x: np.ndarray, y: np.ndarray) -> None:
    request = encode_frame(InferRequest(id=1, version_id=1, inputs=[tensor_of("f", x)]), [x])
    _, (xs,) = decode_frame(request)
    reply = encode_frame(InferResult(id=1, outputs=[tensor_of("p", y)]), [y])
    decode_frame(reply)


def json_round(x: np.ndarray, y: np.ndarray) -> None:
    request = orjson.dumps(
        {
            "type": "infer",
            "id": 1,
            "version_id": 1,
            "inputs": [
                {"name": "f", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}
            ],
        }
    )
    doc = orjson.loads(request)
    np.asarray(doc["inputs"][0]["data"], dtype=np.float32)
    reply = orjson.dumps(
        {
            "type": "result",
            "id": 1,
            "outputs": [
                {"name": "p", "datatype": "FP32", "shape": list(y.shape), "data": y.tolist()}
            ],
        }
    )
    np.asarray(orjson.loads(reply)["outputs"][0]["data"], dtype=np.float32)


def median_us(fn, *args, repeat: int = 7, number: int = 2000) -> float:
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn(*args)
        runs.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(runs)


def main() -> None:
    print("| rows × features | binary frames µs | JSON (orjson) µs | JSON / binary |")
    print("| --- | --- | --- | --- |")
    for rows in (1, 8, 64):
        x = np.random.default_rng(0).normal(size=(rows, 32)).astype(np.float32)
        y = np.random.default_rng(1).random(size=(rows, 2)).astype(np.float32)
        b, j = median_us(binary_round, x, y), median_us(json_round, x, y)
        print(f"| {rows} × 32 | {b:.1f} | {j:.1f} | {j / b:.2f} |")


if __name__ == "__main__":
    main()
