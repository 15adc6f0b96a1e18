"""The torch runtime: outputs equal the module's own, at any batch size, on CPU when CUDA is
asked for but absent, loaded without unpickling anything."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from serving_agent import BadInput, load_runtime, warm_up
from serving_agent._torch import TorchRuntime
from serving_agent.protocol import VersionSpec
from serving_agent.torch_archive import read_archive
from tests.torch_models import conv_net, export, mlp


def saved(tmp_path: Path, archive: bytes) -> Path:
    path = tmp_path / "model.pt2"
    path.write_bytes(archive)
    return path


def spec_for(path: Path, **fields: object) -> VersionSpec:
    archive = read_archive(str(path))
    return VersionSpec(
        version_id=1,
        model="m",
        version=1,
        sha256="0" * 64,
        artifact_url="/a",
        format="torch",
        inputs=archive.inputs,
        outputs=archive.outputs,
        **fields,
    )


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_mlp_outputs_match_the_module_at_every_batch_size(tmp_path: Path, rows: int) -> None:
    module, archive = mlp()
    runtime = TorchRuntime(saved(tmp_path, archive), device="cpu")
    x = np.random.default_rng(rows).normal(size=(rows, 6)).astype(np.float32)
    probabilities, scores = runtime.run({"features": x})
    with torch.no_grad():
        want = module(torch.from_numpy(x))
    np.testing.assert_allclose(probabilities, want[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, want[1].numpy(), rtol=1e-5, atol=1e-5)
    assert runtime.input_names == ["features"]
    assert runtime.output_names == ["output_0", "output_1"]


def test_conv_net_outputs_match_the_module(tmp_path: Path) -> None:
    module, archive = conv_net()
    runtime = TorchRuntime(saved(tmp_path, archive), device="cpu")
    x = np.random.default_rng(0).normal(size=(5, 1, 8, 8)).astype(np.float32)
    (logits,) = runtime.run({"image": x})
    with torch.no_grad():
        np.testing.assert_allclose(logits, module(torch.from_numpy(x)).numpy(), atol=1e-5)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this node may have CUDA")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_cuda_asked_for_without_cuda_runs_on_cpu(tmp_path: Path, device: str) -> None:
    path = saved(tmp_path, mlp()[1])
    spec = spec_for(path, device=device, max_batch_size=16)
    runtime = load_runtime(path, spec, open_runtime=TorchRuntime)
    assert runtime.provider == "torch-cpu"
    assert warm_up(runtime, spec) > 0  # batch 1 and a full batch of 16 went through


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickled")

    path = saved(tmp_path, conv_net()[1])
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    runtime = TorchRuntime(path, device="cpu")
    assert runtime.run({"image": np.zeros((2, 1, 8, 8), np.float32)})[0].shape == (2, 5)


def test_a_batch_beyond_the_exported_range_is_a_bad_input(tmp_path: Path) -> None:
    runtime = TorchRuntime(saved(tmp_path, mlp()[1]), device="cpu")  # exported with max=4096
    with pytest.raises(BadInput, match="dimension 0 is 4097, and the exported program takes"):
        runtime.run({"features": np.zeros((4097, 6), np.float32)})


def test_declared_names_that_differ_from_the_program_fail_the_load(tmp_path: Path) -> None:
    path = saved(tmp_path, mlp()[1])
    spec = spec_for(path)
    spec.inputs[0].name = "x"
    with pytest.raises(ValueError, match="do not match the signature"):
        load_runtime(path, spec, open_runtime=TorchRuntime)


class _ViewWriter(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, 0].add_(1)  # through a view: only the functionalized program shows it
        return x * 2


def test_a_program_writing_its_input_through_a_view_fails_the_load(tmp_path: Path) -> None:
    path = saved(tmp_path, export(_ViewWriter(), torch.randn(3, 4), "x"))
    read_archive(str(path))  # the upload's check cannot see it
    with pytest.raises(ValueError, match="USER_INPUT_MUTATION"):
        TorchRuntime(path, device="cpu")
