"""The ``python`` format's package (serving_agent.package) and its upload check: every way a
package can break the contract is refused at upload with a 400 naming the file or the manifest
key, before anything is extracted or run; good packages record the manifest's signature and
features."""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from registry.formats import TEXTGEN_INPUTS, TEXTGEN_OUTPUTS
from registry.services import create_version
from registry.signature import SignatureError
from serving_agent.package import (
    PackageError,
    extract_package,
    parse_requirements,
    read_package,
)
from tests.factories import make_model
from tests.python_packages import PACKAGES, pack

MANIFEST = b"""
[model]
entrypoint = "model:Model"
features = ["a", "b"]

[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 2]

[[outputs]]
name = "y"
datatype = "FP32"
shape = [-1]
"""
MODEL = b"class Model:\n    def predict(self, batch):\n        return batch['x'].sum(axis=1)\n"


def tar(files: dict[str, bytes], **kinds: str) -> bytes:
    """A gzipped tar of ``files``; ``kinds`` {name: "symlink"|"hardlink"|"fifo"} adds others."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, kind in kinds.items():
            info = tarfile.TarInfo(name)
            info.type = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE}.get(
                kind, tarfile.FIFOTYPE
            )
            info.linkname = "/etc/passwd"
            archive.addfile(info)
    return buffer.getvalue()


def good(**extra: bytes) -> dict[str, bytes]:
    return {"switchyard.toml": MANIFEST, "model.py": MODEL, **extra}


def test_a_good_package_reads_its_manifest_requirements_and_files():
    data = tar(good(**{"requirements.txt": b"# pinned\nRoman==4.2\nfoo_bar[b,a] == 1.0\n"}))
    package = read_package(io.BytesIO(data))
    assert package.manifest.entrypoint == "model:Model"
    assert [t.as_dict() for t in package.manifest.inputs] == [
        {"name": "x", "datatype": "FP32", "shape": [-1, 2]}
    ]
    assert package.requirements == ["foo-bar[a,b]==1.0", "roman==4.2"]
    assert {m.name for m in package.members} == {"switchyard.toml", "model.py", "requirements.txt"}
    # The environment is named by what is installed: the same requirements share one.
    same = read_package(
        io.BytesIO(tar(good(**{"requirements.txt": b"roman==4.2\nfoo-bar[a,b]==1.0"})))
    )
    assert same.environment_key() == package.environment_key()
    assert read_package(io.BytesIO(tar(good()))).environment_key() != package.environment_key()


def test_one_wrapping_folder_a_zip_and_a_folder_are_packages_too(tmp_path):
    wrapped = tar({f"pkg/{k}": v for k, v in good().items()})
    assert read_package(io.BytesIO(wrapped)).prefix == "pkg/"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in good().items():
            archive.writestr(name, data)
    assert read_package(buffer).manifest.cls == "Model"
    extract_package(io.BytesIO(wrapped), tmp_path / "out")
    assert (tmp_path / "out" / "model.py").read_bytes() == MODEL
    assert read_package(tmp_path / "out").manifest.features == ["a", "b"]


@pytest.mark.parametrize(
    ("files", "kinds", "where"),
    [
        ({"model.py": MODEL}, {}, "switchyard.toml"),
        (good(**{"../escape.py": b""}), {}, "../escape.py"),
        (good(**{"/etc/cron.d/x": b""}), {}, "/etc/cron.d/x"),
        (good(), {"link": "symlink"}, "link"),
        (good(), {"hard": "hardlink"}, "hard"),
        (good(), {"pipe": "fifo"}, "pipe"),
        (good(**{"wheels/sub/x.whl": b""}), {}, "wheels/sub/x.whl"),
        (good(**{"requirements.txt": b"roman>=4"}), {}, "requirements.txt:1"),
        (good(**{"requirements.txt": b"--index-url http://evil/\n"}), {}, "requirements.txt:1"),
        (good(**{"requirements.txt": b"x @ https://evil/x.whl"}), {}, "requirements.txt:1"),
        (good(**{"requirements.txt": b"a==1\nA==2"}), {}, "requirements.txt:2"),
        ({"switchyard.toml": MANIFEST}, {}, "model.entrypoint"),
        ({"switchyard.toml": b"[model\n", "model.py": MODEL}, {}, "switchyard.toml"),
    ],
    ids=[
        "no-manifest",
        "dot-dot",
        "absolute",
        "symlink",
        "hardlink",
        "fifo",
        "wheel-folder",
        "range",
        "pip-option",
        "url",
        "twice",
        "no-module",
        "bad-toml",
    ],
)
def test_hostile_or_broken_archives_are_refused_naming_where(files, kinds, where):
    with pytest.raises(PackageError) as refused:
        read_package(io.BytesIO(tar(files, **kinds)))
    assert refused.value.field == where, refused.value


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (b'entrypoint = "model:Model"', b'entrypoint = "os.system"'),
        (b'entrypoint = "model:Model"', b'entrypoint = "../x:Model"'),
        (b'datatype = "FP32"\nshape = [-1, 2]', b'datatype = "FP128"\nshape = [-1, 2]'),
        (b"shape = [-1, 2]", b"shape = [4, 2]"),
        (b"shape = [-1, 2]", b"shape = [-1, 0]"),
        (b'features = ["a", "b"]', b'features = ["a", "a"]'),
        (b'features = ["a", "b"]', b'features = ["a", "b", "c"]'),
    ],
)
def test_bad_manifests_are_refused(change, where):
    manifest = MANIFEST.replace(change, where)
    with pytest.raises(PackageError):
        read_package(io.BytesIO(tar(good(**{"switchyard.toml": manifest}))))


@pytest.mark.parametrize(
    "table",
    [
        b"[resources]\nmemory_mib = 1",
        b"[resources]\ntimeout_s = 0",
        b"[resources]\ncpus = true",
        b'[policy]\nnetwork = "yes"',
    ],
)
def test_resources_and_policy_are_bounded(table):
    with pytest.raises(PackageError):
        read_package(io.BytesIO(tar(good(**{"switchyard.toml": MANIFEST + table}))))


def test_an_archive_bomb_is_refused_before_anything_is_written(tmp_path):
    many = good(**{f"f{i}.txt": b"" for i in range(2001)})
    with pytest.raises(PackageError, match="more than 2000 files"):
        extract_package(io.BytesIO(tar(many)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_requirements_are_pinned_and_normalised():
    assert parse_requirements(b"Foo.Bar==1.0 # why\n\nbaz==2") == ["baz==2", "foo-bar==1.0"]
    with pytest.raises(PackageError):
        parse_requirements(b"\xff")


@pytest.mark.django_db
def test_an_upload_records_the_manifests_signature_and_features(world):
    version = create_version(make_model(world.a, "own"), tar(good()), format="python")
    assert version.inputs == [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]
    assert version.outputs == [{"name": "y", "datatype": "FP32", "shape": [-1]}]
    assert version.feature_names == ["a", "b"]


@pytest.mark.django_db
def test_an_upload_that_breaks_the_contract_is_a_400_naming_where(world, client):
    with pytest.raises(SignatureError) as refused:
        create_version(make_model(world.a, "own"), tar(good(), link="symlink"), format="python")
    assert refused.value.field == "link"
    response = client.post(
        "/api/v1/models/own/versions",
        {"artifact": SimpleUploadedFile("p.tgz", tar({"model.py": MODEL})), "format": "python"},
        headers={"Authorization": f"Bearer {world.key_a}"},
    )
    assert response.status_code == 400, response.content
    assert "switchyard.toml" in response.content.decode()


def test_the_test_packages_are_valid():
    for folder in PACKAGES.iterdir():
        assert read_package(io.BytesIO(pack(folder))).manifest.outputs


# Packages that stream text (format python_generator) ------------------------------------------

GENERATING = b'[model]\nentrypoint = "model:Model"\ngenerates = true\n'
GENERATOR = b"class Model:\n    def generate(self, prompt, parameters):\n        yield prompt\n"


def test_a_generating_package_has_the_fixed_signature_of_generators():
    package = read_package(io.BytesIO(tar({"switchyard.toml": GENERATING, "model.py": GENERATOR})))
    assert package.manifest.generates
    assert [t.as_dict() for t in package.manifest.inputs] == TEXTGEN_INPUTS
    assert [t.as_dict() for t in package.manifest.outputs] == TEXTGEN_OUTPUTS
    assert not read_package(io.BytesIO(tar(good()))).manifest.generates


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        (b"\n[[inputs]]\nname = 'x'\ndatatype = 'FP32'\nshape = [-1]\n", "inputs"),
        (b"\n[[outputs]]\nname = 'y'\ndatatype = 'FP32'\nshape = [-1]\n", "outputs"),
        (b'features = ["a"]\n', "model.features"),
    ],
)
def test_a_generating_package_declares_no_signature_of_its_own(extra, where):
    manifest = GENERATING + extra
    with pytest.raises(PackageError) as refused:
        read_package(io.BytesIO(tar({"switchyard.toml": manifest, "model.py": GENERATOR})))
    assert refused.value.field == where


def test_generates_must_be_a_boolean():
    manifest = GENERATING.replace(b"generates = true", b'generates = "yes"')
    with pytest.raises(PackageError, match="true or false"):
        read_package(io.BytesIO(tar({"switchyard.toml": manifest, "model.py": GENERATOR})))


@pytest.mark.django_db
def test_each_python_format_refuses_the_others_package_pointing_to_the_right_one(world):
    model = make_model(world.a, "own", task="generator")
    generating = tar({"switchyard.toml": GENERATING, "model.py": GENERATOR})
    with pytest.raises(SignatureError, match="format=python_generator") as refused:
        create_version(model, generating, format="python")
    assert refused.value.field == "model.generates"
    with pytest.raises(SignatureError, match="format=python\\)"):
        create_version(model, tar(good()), format="python_generator")
    version = create_version(model, generating, format="python_generator")
    assert version.inputs == TEXTGEN_INPUTS and version.outputs == TEXTGEN_OUTPUTS
    assert version.generates_text
