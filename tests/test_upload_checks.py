"""Upload checks every format goes through: no NaN or infinite weight (``registry.weights``),
one table test over the format table; and an ONNX upload is one self-contained file (no
external data). Each refusal is a 400 in the API's error shape naming the tensor, whether the
upload was held in memory or spooled to disk (ONNX is then checked in a child process)."""

from __future__ import annotations

import io
import json
import shutil
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from registry.formats import FORMATS
from registry.models import ModelVersion
from serving_agent.hf_archive import pack
from tests.classic_models import logistic_regression
from tests.factories import ADMIN_VERSION_FIELDS, key_client, make_model
from tests.hf_models import make_archive
from tests.onnx_models import small_onnx
from tests.python_packages import PACKAGES
from tests.python_packages import pack as pack_package
from tests.textgen_models import tiny_textgen
from tests.torch_models import mlp


@pytest.fixture
def api_a(world):
    make_model(world.a, "clf")
    make_model(world.a, "llm", task="generator")
    return key_client(world.key_a)


def upload(client, artifact: bytes, format: str = "onnx"):
    model = "llm" if FORMATS[format].generates_text else "clf"
    data = {"artifact": SimpleUploadedFile("m.bin", artifact), "format": format}
    return client.post(f"/api/v1/models/{model}/versions", data, format="multipart")


def refused(response, *words: str) -> str:
    """The 400's message, in the API's error shape, once it names the artifact and ``words``."""
    assert response.status_code == 400, response.content
    body = response.json()
    assert set(body["fields"]) == {"artifact"}
    assert body["error"].startswith("artifact: ")
    for word in words:
        assert word in body["error"]
    assert not ModelVersion.objects.exists()
    return body["error"]


@pytest.fixture(params=[False, True], ids=["in-memory", "spooled"])
def spooled(request, settings) -> bool:
    if request.param:
        settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 0  # every upload is a temporary file on disk
    return request.param


# Broken artifacts, made from working ones ---------------------------------------------------


def with_onnx_value(artifact: bytes, value: float) -> bytes:
    """``artifact`` with the first element of its first initializer set to ``value``."""
    model = onnx.load_model_from_string(artifact)
    tensor = model.graph.initializer[0]
    values = numpy_helper.to_array(tensor).copy()
    values.flat[0] = value
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    return model.SerializeToString()


def with_safetensors_value(artifact: bytes, value: float) -> bytes:
    """A safetensors file (all F32) with the first element of its largest tensor set."""
    (header_len,) = struct.unpack_from("<Q", artifact)
    header = json.loads(artifact[8 : 8 + header_len])
    header.pop("__metadata__", None)
    start, end = max((e["data_offsets"] for e in header.values()), key=lambda o: o[1] - o[0])
    at = 8 + header_len + start
    return artifact[:at] + np.float32(value).tobytes() + artifact[at + 4 :]


def with_torch_value(artifact: bytes, value: float) -> bytes:
    """A torch.export archive whose first weight (``hidden.weight``) starts with ``value``."""
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(artifact)) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst,
    ):
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data/weights/weight_0"):
                data = np.float32(value).tobytes() + data[4:]
            dst.writestr(info, data)
    return out.getvalue()


def with_hf_value(directory: Path, value: float) -> bytes:
    """A GPT-2 ``hf`` archive whose model.safetensors has ``value`` in its largest tensor."""
    make_archive("gpt2", directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(with_safetensors_value(weights.read_bytes(), value))
    return pack(directory)


# One broken artifact per format of the table, and the tensor its refusal must name. A format
# added to registry.formats.FORMATS without an entry here fails the test below: give it one,
# and make its check refuse it (registry.weights).
NON_FINITE = {
    "onnx": (lambda tmp: with_onnx_value(small_onnx(), np.nan), "'0.weight' holds NaN"),
    "textgen": (
        lambda tmp: with_safetensors_value(tiny_textgen(), np.inf),
        "'head.weight' holds infinite values",
    ),
    "hf": (
        lambda tmp: with_hf_value(tmp, -np.inf),
        "'model.safetensors:transformer.wpe.weight' holds infinite values",
    ),
    "torch": (lambda tmp: with_torch_value(mlp()[1], np.nan), "'hidden.weight' holds NaN"),
    # A package's weights in a format the registry reads are judged like an upload of it.
    "python": (
        lambda tmp: python_package_with(
            tmp, "artifacts/model.onnx", with_onnx_value(small_onnx(), np.nan)
        ),
        "'artifacts/model.onnx:0.weight' holds NaN",
    ),
    # The same for a package that streams text.
    "python_generator": (
        lambda tmp: python_package_with(
            tmp, "artifacts/model.onnx", with_onnx_value(small_onnx(), np.inf), "word_echo"
        ),
        "'artifacts/model.onnx:0.weight' holds infinite values",
    ),
}


def python_package_with(
    tmp: Path, name: str, data: bytes, package: str = "roman_numerals"
) -> bytes:
    """tests/packages/roman_numerals (or ``package``) with one more file."""
    folder = tmp / "package"
    shutil.copytree(PACKAGES / package, folder)
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return pack_package(folder)


# A composed format (a graph) holds no weights of its own: its nodes' were checked at their upload.
@pytest.mark.parametrize("format", [f for f, entry in FORMATS.items() if entry.runs_on_agent])
def test_every_format_refuses_nan_or_infinite_weights_naming_the_tensor(
    api_a, spooled, tmp_path, format
):
    if format not in NON_FINITE:
        pytest.fail(f"no artifact with NaN weights for the {format!r} format in this test")
    make, problem = NON_FINITE[format]
    refused(upload(api_a, make(tmp_path), format), problem)


def test_classic_ml_weights_in_operator_attributes_are_checked(api_a, spooled):
    """skl2onnx keeps a linear model's coefficients in its operator's attributes."""
    model = onnx.load_model_from_string(logistic_regression().onnx)
    (node,) = [n for n in model.graph.node if n.op_type == "LinearClassifier"]
    (coefficients,) = [a for a in node.attribute if a.name == "coefficients"]
    coefficients.floats[0] = np.nan
    refused(upload(api_a, model.SerializeToString()), "coefficients' holds NaN")


def test_a_one_element_constant_may_be_nan(api_a):
    """Converters write a missing-value marker or a mask's fill value as a one-element tensor
    (skl2onnx's TfidfVectorizer, for one): a constant, not a weight."""
    model = onnx.load_model_from_string(small_onnx())
    model.graph.initializer.append(numpy_helper.from_array(np.array([np.nan], np.float32), "nan"))
    model.graph.node.append(helper.make_node("Identity", ["nan"], ["marker"]))
    model.graph.output.append(helper.make_tensor_value_info("marker", TensorProto.FLOAT, [1]))
    response = upload(api_a, model.SerializeToString())
    assert response.status_code == 201, response.content


def test_the_admin_upload_refuses_them_too(client, django_user_model, world):
    client.force_login(django_user_model.objects.create_superuser("root", "r@example.com", "pw"))
    fields = {"model": make_model(world.a).pk, **ADMIN_VERSION_FIELDS}
    artifact = SimpleUploadedFile("m.onnx", with_onnx_value(small_onnx(), np.inf))
    page = client.post("/admin/registry/modelversion/add/", {**fields, "upload": artifact})
    assert "artifact: weight tensor &#x27;0.weight&#x27; holds infinite" in page.content.decode()
    assert not ModelVersion.objects.exists()


# ONNX external data --------------------------------------------------------------------------


def onnx_with_external(location: str, in_constant: bool = False) -> bytes:
    """A 4 → 2 MatMul whose weight claims to lie in the file ``location`` (ONNX's external
    data), as an initializer or as a ``Constant`` node's value."""
    weight = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
    set_external_data(weight, location=location, offset=0, length=32)
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    if in_constant:
        nodes.insert(0, helper.make_node("Constant", [], ["w"], value=weight))
    graph = helper.make_graph(
        nodes,
        "external",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
        [] if in_constant else [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


@pytest.mark.parametrize(
    "location",
    [
        "manage.py",  # a file in the web process's working directory
        "/etc/passwd",
        "../x",
        "weights.bin",  # even a plain name: nothing but the .onnx file is uploaded
        "link-to-secrets",  # a symlink is only a name too
    ],
)
def test_onnx_external_data_is_refused_naming_the_tensor_and_the_file(api_a, spooled, location):
    message = refused(upload(api_a, onnx_with_external(location)), "'w'", repr(location))
    assert "save_as_external_data=False" in message


def test_external_data_in_an_operators_constant_is_refused_too(api_a, spooled):
    refused(upload(api_a, onnx_with_external("w.bin", in_constant=True)), "'w'", "'w.bin'")


def test_external_data_is_refused_in_the_archives_of_other_formats_too(api_a):
    """hf and torch archives carry no ONNX; the same rule for them is that every file they
    name is a member of the archive (``serving_agent.hf_archive``, ``torch_archive``)."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        link = tarfile.TarInfo("model.safetensors")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    refused(upload(api_a, archive.getvalue(), "hf"), "is a link")
