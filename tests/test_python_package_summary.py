"""What a python version's package holds (``registry.python_package.package_summary`` and
``GET /api/v1/models/{name}/versions/{v}/package``): files, pinned requirements, wheels and
the manifest's entrypoint, resources and policy, read from the stored artifact; another
tenant gets a 404, and a version of another format has no package."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.cache import cache

from registry.python_package import package_summary
from switchyard_client import packaging
from tests.factories import key_client, make_model, make_version


def python_package(folder: Path, requirements: str = "", manifest_extra: str = "") -> bytes:
    """The ``switchyard init`` scaffold, with ``requirements`` and more manifest text, packed
    as ``switchyard push`` packs it."""
    packaging.scaffold(folder, "scorer")
    (folder / "requirements.txt").write_text(requirements)
    manifest = folder / "switchyard.toml"
    manifest.write_text(manifest.read_text().replace("network = false", manifest_extra))
    (folder / "wheels").mkdir()
    (folder / "wheels" / "extra-1.0-py3-none-any.whl").write_bytes(b"PK not really a wheel")
    return packaging.pack(folder, folder.parent / "pkg.tar.gz").path.read_bytes()


@pytest.fixture
def packaged(world, onnx_bytes, tmp_path):
    cache.clear()
    artifact = python_package(
        tmp_path / "scorer", "Roman==4.2\n# a comment\nnumpy==2.1.0\n", "network = true"
    )
    world.scorer = make_version(make_model(world.a, "scorer"), artifact, format="python")
    world.onnx = make_version(make_model(world.a, "clf"), onnx_bytes)
    return world


def test_the_summary_lists_files_requirements_and_the_manifest(packaged):
    summary = package_summary(packaged.scorer)
    assert summary is not None and summary["error"] is None
    assert summary["entrypoint"] == "model:Model"
    assert summary["resources"] == {"memory_mib": 1024, "cpus": 1.0, "timeout_s": 30.0}
    assert summary["policy"] == {"network": True}
    assert summary["features"] == ["f1", "f2", "f3", "f4"]
    assert summary["requirements"] == ["numpy==2.1.0", "roman==4.2"]  # normalised, sorted
    assert [w["name"] for w in summary["wheels"]] == ["extra-1.0-py3-none-any.whl"]
    names = [f["name"] for f in summary["files"]]
    assert names == [
        "model.py",
        "requirements.txt",
        "switchyard.toml",
        "weights.json",
        "wheels/extra-1.0-py3-none-any.whl",
    ]
    assert summary["total_bytes"] == sum(f["size"] for f in summary["files"]) > 0


def test_another_format_has_no_package(packaged):
    assert package_summary(packaged.onnx) is None


def test_a_stored_artifact_that_is_gone_is_an_error_not_a_crash(packaged):
    packaged.scorer.artifact.storage.delete(packaged.scorer.artifact.name)
    summary = package_summary(packaged.scorer)
    assert summary is not None and summary["error"].startswith("the stored artifact cannot")


def test_the_api_answers_the_summary(packaged):
    answer = key_client(packaged.key_a).get("/api/v1/models/scorer/versions/1/package")
    assert answer.status_code == 200, answer.content
    assert answer.json()["requirements"] == ["numpy==2.1.0", "roman==4.2"]
    assert answer.json()["entrypoint"] == "model:Model"


def test_the_api_has_no_package_for_another_format(packaged):
    answer = key_client(packaged.key_a).get("/api/v1/models/clf/versions/1/package")
    assert answer.status_code == 404 and "not a python package" in answer.json()["error"]


def test_other_tenant_gets_404(packaged):
    answer = key_client(packaged.key_b).get("/api/v1/models/scorer/versions/1/package")
    assert answer.status_code == 404
    assert b"roman" not in answer.content
