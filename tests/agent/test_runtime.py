"""The ONNX runtime: provider choice, outputs, and the signature check at load."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort
import pytest

from serving_agent import BadInput, OnnxRuntime, load_runtime, warm_up
from serving_agent.protocol import TensorSpec, VersionSpec

if TYPE_CHECKING:
    from tests.agent.conftest import TinyModel


def reference(model: TinyModel, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model.path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_outputs_match_onnxruntime(tiny_model: TinyModel) -> None:
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    runtime = OnnxRuntime(tiny_model.path, device="cpu")
    (y,) = runtime.run({"x": x})
    np.testing.assert_allclose(y, reference(tiny_model, x), rtol=1e-6)
    assert runtime.input_names == ["x"] and runtime.output_names == ["y"]
    assert runtime.provider == "CPUExecutionProvider"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this node may have CUDA")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_cuda_without_cuda_libraries_falls_back_to_cpu(tiny_model: TinyModel, device: str) -> None:
    runtime = OnnxRuntime(tiny_model.path, device=device)
    assert runtime.provider == "CPUExecutionProvider"
    assert runtime.run({"x": np.zeros((1, 4), np.float32)})[0].shape == (1, 2)


def test_a_cuda_session_that_raises_falls_back_to_cpu(
    tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[list[str]] = []
    real = ort.InferenceSession

    def session(path: str, options: Any, providers: list[str]) -> ort.InferenceSession:
        asked.append(providers)
        if "CUDAExecutionProvider" in providers:
            raise RuntimeError("no CUDA here")
        return real(path, options, providers=providers)

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider"])
    monkeypatch.setattr(ort, "InferenceSession", session)
    runtime = OnnxRuntime(tiny_model.path, device="cuda")
    assert runtime.provider == "CPUExecutionProvider"
    assert asked == [["CUDAExecutionProvider", "CPUExecutionProvider"], ["CPUExecutionProvider"]]


def test_device_cpu_never_tries_cuda(
    tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[list[str]] = []
    real = ort.InferenceSession

    def session(path: str, options: Any, providers: list[str]) -> ort.InferenceSession:
        asked.append(providers)
        return real(path, options, providers=providers)

    monkeypatch.setattr(ort, "InferenceSession", session)
    OnnxRuntime(tiny_model.path, device="cpu")
    assert asked == [["CPUExecutionProvider"]]


def test_inputs_the_session_rejects_are_bad_input(tiny_model: TinyModel) -> None:
    runtime = OnnxRuntime(tiny_model.path, device="cpu")
    with pytest.raises(BadInput):
        runtime.run({"x": np.zeros((1, 5), np.float32)})
    with pytest.raises(BadInput):
        runtime.run({"z": np.zeros((1, 4), np.float32)})


def test_load_refuses_a_model_whose_signature_differs(
    tiny_model: TinyModel, make_spec: Callable[..., VersionSpec]
) -> None:
    spec = make_spec(inputs=[TensorSpec(name="features", datatype="FP32", shape=[-1, 4])])
    with pytest.raises(ValueError, match="do not match"):
        load_runtime(tiny_model.path, spec)


def test_warm_up_checks_full_batches_and_measures_batch_one(
    tiny_model: TinyModel, make_spec: Callable[..., VersionSpec]
) -> None:
    spec = make_spec(max_batch_size=16)
    runtime = load_runtime(tiny_model.path, spec)
    latency = warm_up(runtime, spec)
    assert 0 < latency < 0.1
