"""INT8 variants of ONNX versions: ONNX Runtime's dynamic quantisation (weights stored as INT8,
activations quantised on the fly), made into a new immutable version whose parent is the
original, with what it costs in accuracy and gains in speed measured before it is kept.

The variant is an ordinary ONNX version: it is served, canaried and promoted like any other,
so the measured numbers here are a first look and the canary's guardrails the real test.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from django.core.files import File

from platform_site.errors import Invalid
from serving_agent.protocol import OIP_TO_NUMPY
from tenants.audit import SYSTEM, Actor

from . import services
from .formats import labels_where
from .models import ModelVersion

SAMPLE_ROWS = 64  # rows of the sample both graphs answer
TIMED_RUNS = 30  # timed runs of each graph on the sample, after a warm-up
SEED = 0


def quantize_version(
    version: ModelVersion, actor: Actor = SYSTEM, created_by_id: int | None = None
) -> ModelVersion:
    """A new version of the same model: ``version``'s graph with INT8 weights, its lineage
    holding the method and the measured difference and speed-up; the original is untouched."""
    if not version.format_entry.quantizable:
        raise Invalid(
            "version",
            f"only {labels_where(lambda f: f.quantizable)} versions can be quantised; "
            f"this one is {version.format}",
        )
    if version.tokenizer:
        raise Invalid("version", "versions that take text (a tokenizer) are not quantised")
    sample, kind = _sample(version)
    with tempfile.TemporaryDirectory(prefix="switchyard-quantize-") as tmp:
        source, target = Path(tmp) / "model.onnx", Path(tmp) / "model.int8.onnx"
        with version.artifact.open("rb") as fh, open(source, "wb") as out:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                out.write(chunk)
        _quantize(source, target)
        report = {"sample": kind, **measure(source, target, sample)}
        with open(target, "rb") as fh:
            return services.create_version(
                version.model,
                File(fh, name=f"v{version.version}.int8.onnx"),
                actor=actor,
                created_by_id=created_by_id,
                parent=version,
                feature_names=version.feature_names or None,
                offline_metrics=version.offline_metrics,
                lineage={"quantized": {"from_version": version.version, **report}},
            )


def _quantize(source: Path, target: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        quantize_dynamic(source, target, weight_type=QuantType.QInt8)
    except Exception as exc:  # an operator set the tool cannot handle: say so, as a 400
        raise Invalid("version", f"ONNX Runtime could not quantise this graph: {exc}") from None


def _sample(version: ModelVersion) -> tuple[dict[str, np.ndarray], str]:
    """The inputs both graphs answer: the version's drift reference when it holds the one
    tabular input's columns, else seeded random values of each input's type and shape."""
    rng = np.random.default_rng(SEED)
    feed: dict[str, np.ndarray] = {}
    reference = getattr(version, "reference", None)
    inputs = version.inputs or []
    names = version.feature_names or []
    if reference is not None and len(inputs) == 1 and names:
        columns = reference.columns
        if all(isinstance(columns.get(n), list) for n in names):
            rows = np.array([columns[n] for n in names], dtype=np.float64).T[:SAMPLE_ROWS]
            dtype = OIP_TO_NUMPY[inputs[0]["datatype"]]
            return {inputs[0]["name"]: rows.astype(dtype)}, "the version's drift reference"
    for spec in inputs:
        dtype = np.dtype(OIP_TO_NUMPY[spec["datatype"]])
        shape = [
            SAMPLE_ROWS if i == 0 and d < 0 else (d if d > 0 else 1)
            for i, d in enumerate(spec["shape"])
        ]
        if dtype.kind == "f":
            feed[spec["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feed[spec["name"]] = rng.integers(0, 2, shape).astype(dtype)
        elif dtype.kind == "b":
            feed[spec["name"]] = rng.integers(0, 2, shape).astype(bool)
        else:
            raise Invalid(
                "version", f"input {spec['name']!r} ({spec['datatype']}) cannot be sampled"
            )
    return feed, f"seeded random (seed {SEED})"


def measure(source: Path, target: Path, feed: dict[str, np.ndarray]) -> dict[str, Any]:
    """Both graphs on the same sample, one thread each: the largest and mean absolute output
    difference, how often the arg-max of a 2-D output agrees, and the median time per run."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    sessions = [
        ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"])
        for p in (source, target)
    ]
    answers = [s.run(None, feed) for s in sessions]
    times = [_median_ms(s, feed) for s in sessions]
    outputs: dict[str, Any] = {}
    for meta, before, after in zip(sessions[0].get_outputs(), answers[0], answers[1], strict=True):
        if not np.issubdtype(np.asarray(before).dtype, np.number):
            continue  # labels (strings): compared through the probabilities beside them
        diff = np.abs(np.asarray(after, np.float64) - np.asarray(before, np.float64))
        entry: dict[str, Any] = {
            "max_abs_diff": float(diff.max(initial=0.0)),
            "mean_abs_diff": float(diff.mean()) if diff.size else 0.0,
        }
        if np.ndim(before) == 2 and np.shape(before)[1] > 1:
            agree = np.argmax(before, axis=1) == np.argmax(after, axis=1)
            entry["argmax_agreement"] = float(agree.mean())
        outputs[meta.name] = entry
    return {
        "method": "onnxruntime dynamic quantisation, INT8 weights",
        "sample_rows": int(next(iter(feed.values())).shape[0]) if feed else 0,
        "outputs": outputs,
        "ms_per_run": {"original": round(times[0], 4), "int8": round(times[1], 4)},
        "speedup": round(times[0] / times[1], 3) if times[1] > 0 else None,
        "bytes": {"original": source.stat().st_size, "int8": target.stat().st_size},
    }


def _median_ms(session: Any, feed: dict[str, np.ndarray]) -> float:
    session.run(None, feed)  # warm-up
    runs = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        session.run(None, feed)
        runs.append((time.perf_counter() - start) * 1000)
    return statistics.median(runs)
