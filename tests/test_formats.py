"""The format table: one entry per model format on the platform's side (``registry.formats``)
and one on the agent's (``serving_agent.formats``), the same formats in both; OIP metadata names
the runtime that really serves each format; and a format added as one entry on each side is
checked at upload, described by OIP and served by an agent through the generic path alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator

from fleet.assignments import version_spec
from gateway import oip
from gateway.routes import route_of
from gateway.state import GatewayState
from platform_site.asgi import application
from registry import formats as registry_formats
from registry.services import create_version
from registry.signature import SignatureError
from serving_agent import FunctionRuntime, Runtime, load_runtime
from serving_agent import formats as agent_formats
from serving_agent.protocol import Assign, VersionSpec
from tests.agent.test_versions import FakeCache, make_versions
from tests.classic_models import logistic_regression
from tests.factories import make_model, make_version
from tests.hf_models import make_archive
from tests.onnx_models import small_onnx
from tests.textgen_models import tiny_textgen
from tests.torch_models import mlp


def test_every_format_has_an_entry_on_both_sides():
    # A composed format (a graph) runs on the gateway from other versions: no agent loads it,
    # so the agent's table has no entry for it, and it neither streams nor generates text.
    on_agents = [v for v, entry in registry_formats.FORMATS.items() if entry.runs_on_agent]
    assert on_agents == list(agent_formats.FORMATS)
    for value, entry in registry_formats.FORMATS.items():
        assert entry.value == value
        if not entry.runs_on_agent:
            assert entry.compose is not None and not entry.generates_text
            continue
        # What the gateway answers generation with is what the agent loads onto an engine.
        assert entry.generates_text == agent_formats.FORMATS[value].streams


def test_every_agent_loader_names_a_function():
    for entry in agent_formats.FORMATS.values():
        assert callable(entry.load_function()), entry.loader


# OIP metadata's platform, per format ---------------------------------------------------------


def _artifact(kind: str, tmp_path: Path) -> bytes:
    if kind == "torch":
        return mlp()[1]
    if kind == "classic":  # scikit-learn converted with skl2onnx: an ONNX upload
        return logistic_regression().onnx
    if kind == "textgen":
        return tiny_textgen()
    if kind == "hf":
        return make_archive("gpt2", tmp_path)[0]
    return small_onnx()


@pytest.fixture
def state(monkeypatch) -> GatewayState:
    gateway = GatewayState()
    monkeypatch.setattr(oip, "get_state", lambda: gateway)
    return gateway


async def get(path: str, key: str) -> tuple[int, dict]:
    headers = [(b"authorization", f"Bearer {key}".encode())]
    response = await HttpCommunicator(application, "GET", path, headers=headers).get_response(
        timeout=10
    )
    return response["status"], json.loads(response["body"])


@pytest.mark.django_db
@pytest.mark.parametrize(
    "kind, format, platform",
    [
        ("onnx", "onnx", "onnxruntime_onnx"),
        ("classic", "onnx", "onnxruntime_onnx"),
        ("torch", "torch", "pytorch"),
        ("textgen", "textgen", "switchyard_textgen"),
        ("hf", "hf", "huggingface_transformers"),
    ],
)
def test_oip_metadata_names_the_runtime_that_serves_the_format(
    world, state, tmp_path, kind, format, platform
):
    task = "generator" if format in ("textgen", "hf") else "classifier"
    make_version(make_model(world.a, "m", task=task), _artifact(kind, tmp_path), format=format)
    status, meta = async_to_sync(get)("/v2/models/m", world.key_a)
    assert status == 200, meta
    assert meta["platform"] == platform


# Adding a format: one entry on each side -------------------------------------------------------
#
# "scale": a JSON file {"scale": s}; the model multiplies its input by s.

SCALE_SIGNATURE = (
    [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
    [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
)


def check_scale(upload) -> registry_formats.Signature:
    upload.seek(0)
    try:
        scale = json.loads(upload.read())["scale"]
    except (ValueError, KeyError, TypeError):
        raise SignatureError("artifact", 'not a scale model: no {"scale": ...}') from None
    if not isinstance(scale, int | float):
        raise SignatureError("artifact", "not a scale model: the scale is not a number")
    return SCALE_SIGNATURE


def load_scale(path: Path, spec: VersionSpec, threads: int = 1, *, wrap=None) -> Runtime:
    def open_scale(path: Path, device: str, threads: int) -> Runtime:
        scale = np.float32(json.loads(path.read_bytes())["scale"])
        return FunctionRuntime(lambda inputs: [inputs["x"] * scale], ["x"], ["y"], "scale")

    return load_runtime(path, spec, threads, open_scale, wrap)


@pytest.fixture
def scale_format(monkeypatch) -> None:
    """The new format's two entries, for this test only."""
    monkeypatch.setitem(
        registry_formats.FORMATS,
        "scale",
        registry_formats.Format(
            "scale", "Scale (JSON)", platform="scale_json", check=check_scale, extension="json"
        ),
    )
    monkeypatch.setitem(
        agent_formats.FORMATS, "scale", agent_formats.Format("tests.test_formats:load_scale")
    )


@pytest.mark.django_db
def test_a_format_added_as_one_entry_on_each_side_is_checked_described_and_served(
    world, state, scale_format, tmp_path
):
    model = make_model(world.a, "scaler")
    with pytest.raises(SignatureError, match="not a scale model"):
        create_version(model, b'{"factor": 2}', format="scale")
    version = make_version(model, b'{"scale": 3}', format="scale")
    assert (version.inputs, version.outputs) == SCALE_SIGNATURE
    assert version.artifact.name.endswith(".json")

    status, meta = async_to_sync(get)("/v2/models/scaler", world.key_a)
    assert (status, meta["platform"]) == (200, "scale_json")
    assert route_of(version).platform == "scale_json"

    # The agent loads what the platform assigns through the same generic path as ONNX.
    spec = version_spec(version)
    artifact = tmp_path / "scale.json"
    artifact.write_bytes(b'{"scale": 3}')

    async def served() -> list[np.ndarray]:
        versions, statuses = make_versions(FakeCache(artifact))
        versions.apply(Assign(versions=[spec]))
        ready = await statuses.expect("ready", version.pk)
        assert ready.provider == "scale"
        runtime = versions.loaded[version.pk].runtime
        return runtime.run({"x": np.ones((2, 2), np.float32)})

    [y] = asyncio.run(served())
    assert y.tolist() == [[3, 3], [3, 3]]


@pytest.mark.django_db
def test_a_format_unknown_to_the_agent_fails_only_that_version(world, tmp_path):
    version = make_version(make_model(world.a), small_onnx())
    spec = version_spec(version).model_copy(update={"format": "newer"})

    async def failed() -> str:
        versions, statuses = make_versions(FakeCache(tmp_path / "unused"))
        versions.apply(Assign(versions=[spec]))
        return (await statuses.expect("failed", version.pk)).detail

    assert asyncio.run(failed()) == "this agent does not serve the 'newer' format"
