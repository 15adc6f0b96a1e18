"""Uploads over the API: a torch.export archive gets its signature read from the archive; a
pickle is refused with a clear 400 whatever format it claims; hostile archives are refused."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from django.core.files.uploadedfile import SimpleUploadedFile
from sklearn.linear_model import LogisticRegression

from registry import formats
from registry.models import ModelVersion
from registry.services import create_version
from registry.signature import SignatureError
from serving_agent.pickles import pickle_kind
from serving_agent.torch_archive import read_archive
from tests.factories import key_client, make_model
from tests.torch_models import mlp, rewrite_json


def upload(client, artifact: bytes, format: str, name: str = "m.bin", **fields):
    data = {"artifact": SimpleUploadedFile(name, artifact), "format": format, **fields}
    return client.post("/api/v1/models/clf/versions", data, format="multipart")


@pytest.fixture
def api_a(world):
    make_model(world.a, "clf")
    return key_client(world.key_a)


def sklearn_pickle(protocol: int = 5) -> bytes:
    x = np.random.default_rng(0).normal(size=(20, 3))
    return pickle.dumps(LogisticRegression().fit(x, x[:, 0] > 0), protocol=protocol)


def torch_state_dict() -> bytes:
    buffer = io.BytesIO()
    torch.save(mlp()[0].state_dict(), buffer)
    return buffer.getvalue()


def test_a_torch_export_archive_is_stored_with_the_signature_it_holds(api_a):
    response = upload(api_a, mlp()[1], "torch", "mlp.pt2")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["format"] == "torch"
    assert body["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 6]}]
    assert [o["name"] for o in body["outputs"]] == ["output_0", "output_1"]


def test_a_declared_signature_must_agree_with_the_archive(api_a):
    bad = '[{"name": "features", "datatype": "FP64", "shape": [-1, 6]}]'
    response = upload(api_a, mlp()[1], "torch", inputs=bad)
    assert response.status_code == 400
    assert "FP64" in response.json()["error"] and not ModelVersion.objects.exists()


@pytest.mark.parametrize("format", ["onnx", "torch", "textgen"])
@pytest.mark.parametrize(
    ("artifact", "kind"),
    [
        (sklearn_pickle, "a pickle (protocol 5)"),
        (lambda: sklearn_pickle(protocol=0), "a pickle (protocol 0 or 1)"),
        (torch_state_dict, "a zip archive holding pickled"),
    ],
    ids=["sklearn-pickle", "sklearn-pickle-protocol-0", "torch-save"],
)
def test_a_pickle_is_refused_whatever_format_it_claims(api_a, format, artifact, kind):
    response = upload(api_a, artifact(), format)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error.startswith("artifact: pickle files are refused:"), error
    assert kind in error
    assert not ModelVersion.objects.exists()


def test_a_pickled_tokenizer_is_refused(world, onnx_bytes):
    model = make_model(world.a, "tok")
    with pytest.raises(SignatureError, match="pickle files are refused") as refused:
        create_version(model, onnx_bytes, tokenizer=pickle.dumps({"vocab": {}}))
    assert refused.value.field == "tokenizer"


@pytest.mark.parametrize(
    ("artifact", "message"),
    [
        (b"PK\x03\x04 not really a zip", "not a zip archive"),
        (
            rewrite_json(
                mlp()[1],
                "models/model.json",
                lambda p: p["graph_module"]["graph"]["nodes"][0].update(target="torch.os.system"),
            ),
            "calls 'torch.os.system'",
        ),
    ],
)
def test_an_archive_that_is_not_a_safe_export_is_refused(api_a, artifact, message):
    response = upload(api_a, artifact, "torch")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error.startswith("artifact: not a valid torch.export archive:") and message in error


def test_a_tokenizer_given_as_text_is_checked_too(world, onnx_bytes):
    model = make_model(world.a, "tok")
    text = pickle.dumps({"vocab": {}}, protocol=0).decode()
    with pytest.raises(SignatureError, match="pickle files are refused"):
        create_version(model, onnx_bytes, tokenizer=text)


def test_files_that_are_not_pickles_are_not_mistaken_for_one(onnx_bytes):
    for data in (onnx_bytes, mlp()[1], b'{"model": {"vocab": {}}}', b"plain text\n" * 50):
        assert pickle_kind(io.BytesIO(data)) is None


def test_uploads_spooled_to_disk_are_checked_from_disk(api_a, settings, monkeypatch):
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1  # every upload goes to a temporary file
    read = []
    monkeypatch.setattr(formats, "read_archive", lambda f: read.append(f) or read_archive(f))
    assert upload(api_a, mlp()[1], "torch", "mlp.pt2").status_code == 201
    assert [type(f) for f in read] == [str]  # a path: read from disk, not into memory
    refused = upload(api_a, torch_state_dict(), "torch")
    assert refused.status_code == 400
    assert "pickle files are refused" in refused.json()["error"]
