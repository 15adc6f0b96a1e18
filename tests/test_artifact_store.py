"""Artifacts on local disk are stored once per tenant (``registry.services.store_once``): the
same bytes uploaded again reuse the stored file, another tenant's identical upload is stored
in its own folder, and deleting a version leaves a file other versions refer to. The same
rules against S3 are in tests/test_storage_s3.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from onnx import TensorProto, helper

from registry.models import ModelVersion
from registry.services import create_version
from tests.factories import key_client, make_model
from tests.hf_models import train_tokenizer
from tests.onnx_models import small_onnx


@pytest.fixture
def media(settings, tmp_path) -> Path:
    settings.MEDIA_ROOT = str(tmp_path)
    return tmp_path


def upload(key: str, artifact: bytes, model: str = "clf"):
    data = {"artifact": SimpleUploadedFile("m.onnx", artifact)}
    response = key_client(key).post(f"/api/v1/models/{model}/versions", data, format="multipart")
    assert response.status_code == 201, response.content
    return ModelVersion.objects.latest("pk")


def stored(media: Path, tenant) -> list[str]:
    return sorted(p.name for p in (media / "artifacts" / str(tenant.pk)).iterdir())


@pytest.mark.parametrize("spooled", [False, True], ids=["in-memory", "spooled"])
def test_the_same_bytes_uploaded_twice_are_stored_once(world, media, settings, spooled):
    if spooled:
        settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 0
    make_model(world.a, "clf")
    make_model(world.a, "other")
    artifact = small_onnx()
    first = upload(world.key_a, artifact)
    again = upload(world.key_a, artifact)
    elsewhere = upload(world.key_a, artifact, model="other")
    assert first.artifact.name == again.artifact.name == elsewhere.artifact.name
    assert stored(media, world.a) == [f"{first.sha256}.onnx"]
    different = upload(world.key_a, small_onnx(seed=1))
    assert stored(media, world.a) == sorted([f"{first.sha256}.onnx", f"{different.sha256}.onnx"])


def test_a_tokenizer_uploaded_again_is_stored_once(world, media):
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["ids"])],
        "ids",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    tokenizer = train_tokenizer().to_str().encode()
    clf = make_model(world.a)
    first, again = (
        create_version(clf, model.SerializeToString(), tokenizer=tokenizer) for _ in range(2)
    )
    assert first.tokenizer.name == again.tokenizer.name
    assert [n for n in stored(media, world.a) if n.endswith(".tokenizer.json")] == [
        f"{first.tokenizer_sha256}.tokenizer.json"
    ]


def test_another_tenants_identical_upload_is_stored_apart(world, media):
    """Reusing another tenant's file would tell a tenant what another uploaded (by timing, or
    by the file's name): each tenant's uploads are only matched against its own."""
    make_model(world.a, "clf")
    make_model(world.b, "clf")
    artifact = small_onnx()
    mine, theirs = upload(world.key_a, artifact), upload(world.key_b, artifact)
    assert mine.artifact.name != theirs.artifact.name
    assert stored(media, world.a) == stored(media, world.b) == [f"{mine.sha256}.onnx"]


def test_deleting_a_version_keeps_the_bytes_another_still_uses(world, media):
    make_model(world.a, "clf")
    artifact = small_onnx()
    first, second = upload(world.key_a, artifact), upload(world.key_a, artifact)
    first.delete()  # as the admin deletes a version
    with second.artifact.open("rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == second.sha256


def test_a_partial_file_under_the_name_is_not_reused(world, media):
    """A file of that name but another size (a copy cut short) is never taken for the upload:
    the new bytes are stored beside it under a name of their own."""
    make_model(world.a, "clf")
    artifact = small_onnx()
    digest = hashlib.sha256(artifact).hexdigest()
    folder = media / "artifacts" / str(world.a.pk)
    folder.mkdir(parents=True)
    (folder / f"{digest}.onnx").write_bytes(artifact[:100])
    version = upload(world.key_a, artifact)
    assert version.artifact.name != f"artifacts/{world.a.pk}/{digest}.onnx"
    with version.artifact.open("rb") as f:
        assert f.read() == artifact
