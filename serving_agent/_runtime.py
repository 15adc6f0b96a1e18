"""Model runtimes: one small base class and ONNX Runtime (exported torch programs are in
``_torch``, imported only by nodes that serve them)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from ._classic import Labels, as_matrices, class_labels
from ._exceptions import BadInput
from ._signature import check_signature, zeros_feed
from .protocol import VersionSpec

logger = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


class Runtime:
    """A loaded model that runs a batch: named input arrays in, outputs in ``output_names`` order.

    ``run`` is blocking and may be called from a worker thread, one call at a time per runtime.
    """

    input_names: list[str]
    output_names: list[str]
    provider: str  # what actually runs the model, e.g. "CUDAExecutionProvider"
    # ``run`` waits on another process (a python package's worker, up to its timeout): never
    # run it on the event loop, however fast its warm-up was.
    blocks: bool = False

    def outside_bytes(self) -> int:
        """Memory the model holds outside the agent's process (a worker's), for its footprint."""
        return 0

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the model's memory; the runtime is not used afterwards."""


class FunctionRuntime(Runtime):
    """A runtime backed by a Python function; for tests and for trying the agent without a model."""

    def __init__(
        self,
        fn: Callable[[dict[str, np.ndarray]], list[np.ndarray]],
        input_names: list[str],
        output_names: list[str],
        provider: str = "python",
    ) -> None:
        self._fn = fn
        self.input_names = input_names
        self.output_names = output_names
        self.provider = provider

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self._fn(inputs)


_cpu_fallback_logged = False


def _log_cpu_fallback(device: str, reason: str) -> None:
    # Every model on a node without working CUDA falls back the same way; say it once.
    global _cpu_fallback_logged
    level = logging.DEBUG if _cpu_fallback_logged else logging.WARNING
    logger.log(level, "CUDA unusable for device=%s, running on CPU: %s", device, reason)
    _cpu_fallback_logged = True


def create_session(path: Path, device: str, options: ort.SessionOptions) -> ort.InferenceSession:
    """A session on CUDA when asked for (or "auto") and it really works there, else on CPU."""
    if device != "cpu" and CUDA in ort.get_available_providers():
        # onnxruntime-gpu lists CUDA even without the CUDA libraries and then quietly runs
        # on CPU, so what counts is the provider the session ends up with.
        try:
            session = ort.InferenceSession(str(path), options, providers=[CUDA, CPU])
        except Exception as exc:  # noqa: BLE001 - any CUDA failure means "use CPU"
            _log_cpu_fallback(device, str(exc))
        else:
            if session.get_providers()[0] == CUDA:
                return session
            _log_cpu_fallback(device, "the CUDA provider did not initialize")
            return session  # it already fell back to CPU; no need to load the model twice
    return ort.InferenceSession(str(path), options, providers=[CPU])


class OnnxRuntime(Runtime):
    """An ONNX Runtime session."""

    def __init__(
        self,
        path: Path | str,
        device: str = "auto",
        threads: int = 1,
        labels: dict[str, Labels] | None = None,
    ) -> None:
        # {output name: class labels} for a classifier's ZipMap outputs (see ``_classic``)
        self._labels = labels or {}
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1  # one batch at a time per version; parallelism is intra-op
        if self._labels:
            # Converted classifiers declare outputs ONNX Runtime then warns about on every run
            # (onnxmltools gives LightGBM's label a batch of 1): a log line per batch. The
            # registry already recorded their real shapes; errors are still logged.
            options.log_severity_level = 3
        self._session: ort.InferenceSession | None = create_session(Path(path), device, options)
        self.input_names = [i.name for i in self._session.get_inputs()]
        # Element types ("tensor(int64)") and shapes (ints, or names for dynamic dims) by input
        # name: what a tokenizer must feed.
        self.input_types = {i.name: i.type for i in self._session.get_inputs()}
        self.input_shapes = {i.name: list(i.shape) for i in self._session.get_inputs()}
        self.output_names = [o.name for o in self._session.get_outputs()]
        self.provider = self._session.get_providers()[0]

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self._session is None:
            raise RuntimeError("runtime is closed")
        for name, kind in self.input_types.items():
            if kind == "tensor(string)" and name in inputs:
                inputs = {**inputs, name: _as_text(name, inputs[name])}
        try:
            outputs = self._session.run(self.output_names, inputs)
        except (InvalidArgument, ValueError) as exc:  # wrong names, shapes or dtypes
            raise BadInput(str(exc)) from exc
        if self._labels:
            return as_matrices(self.output_names, outputs, self._labels)
        return outputs

    def close(self) -> None:
        self._session = None


def _as_text(name: str, array: np.ndarray) -> np.ndarray:
    """A BYTES input (``bytes`` elements) as the str elements ONNX Runtime's string tensors
    take: given ``bytes`` it would store their ``repr``."""
    out = np.empty(array.shape, dtype=object)
    flat = out.reshape(-1)
    try:
        for i, value in enumerate(array.reshape(-1).tolist()):
            flat[i] = value.decode() if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise BadInput(f"input {name!r}: not valid UTF-8 text ({exc.reason})") from None
    return out


# Opens an artifact as a runtime: (path, device, threads) -> Runtime.
RuntimeOpener = Callable[[Path, str, int], Runtime]


def load_runtime(
    path: Path,
    spec: VersionSpec,
    threads: int = 1,
    open_runtime: RuntimeOpener | None = None,
    wrap: Callable[[Runtime], Runtime] | None = None,
) -> Runtime:
    """Load ``spec``'s artifact and check the model has the signature the platform declared.

    ``open_runtime`` opens another format than ONNX (torch); ``wrap`` puts something in front
    of the graph first (a tokenizer: ``_text``)."""
    check_signature(spec.inputs)
    check_signature(spec.outputs)
    if open_runtime is None:  # ONNX: a converted classifier's outputs need its class labels
        runtime: Runtime = OnnxRuntime(path, spec.device, threads, class_labels(spec.outputs))
    else:
        runtime = open_runtime(path, spec.device, threads)
    if wrap is not None:
        try:
            runtime = wrap(runtime)
        except BaseException:
            runtime.close()
            raise
    for kind, declared, actual in (
        ("inputs", [t.name for t in spec.inputs], runtime.input_names),
        ("outputs", [t.name for t in spec.outputs], runtime.output_names),
    ):
        if sorted(declared) != sorted(actual):
            runtime.close()
            raise ValueError(f"model {kind} {actual} do not match the signature's {declared}")
    return runtime


def check_output_rows(outputs: list[np.ndarray], rows: int) -> None:
    """Every output must have one row per input row, or it cannot be split back per request."""
    for i, out in enumerate(outputs):
        if out.ndim == 0 or out.shape[0] != rows:
            raise RuntimeError(
                f"output {i} has shape {list(out.shape)}, expected {rows} rows (one per input row)"
            )


def warm_up(runtime: Runtime, spec: VersionSpec, timed_runs: int = 10) -> float:
    """Run zeros through the model at batch 1 and at full batch; returns warm batch-1 seconds."""
    one = zeros_feed(spec.inputs, 1)
    for _ in range(2):  # first runs allocate buffers and pick kernels; not representative
        check_output_rows(runtime.run(one), 1)
    if spec.max_batch_size > 1:
        # A model with a fixed batch of 1 fails here, at load, not on the first busy minute.
        full = zeros_feed(spec.inputs, spec.max_batch_size)
        check_output_rows(runtime.run(full), spec.max_batch_size)
    times: list[float] = []
    deadline = time.perf_counter() + 1.0  # bound the warm-up of slow models
    while len(times) < timed_runs and (not times or time.perf_counter() < deadline):
        start = time.perf_counter()
        runtime.run(one)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
