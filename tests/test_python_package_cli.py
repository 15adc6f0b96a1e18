"""`switchyard init`, `push MODEL DIR` and `versions show` for python model packages: the
scaffold passes the local check as written, a broken package fails on the author's machine with
its error and nothing uploaded, a folder is uploaded as a deterministic .tar.gz of format python,
and a version's state on the agents (an environment's build failure with the installer's error)
is shown. The CLI talks to the platform in this process (Django's WSGI handler under httpx)."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from fleet.models import AgentSession
from fleet.nodes import create_node
from registry.models import ModelVersion
from serving_agent.package import read_package
from switchyard_client import cli as cli_module
from switchyard_client import packaging
from switchyard_client.sdk import Client
from tests.factories import make_model, make_session

INSTALLER_ERROR = (
    "building environment failed: ERROR: Could not find a version that satisfies the "
    "requirement scikit-learn==0.0.1\nERROR: No matching distribution found for "
    "scikit-learn==0.0.1"
)


@pytest.fixture
def platform(world, monkeypatch):
    """Tenant A's model ``scorer``; the CLI's client speaks to this process's platform with
    A's key."""
    world.scorer = make_model(world.a, "scorer")

    def in_process() -> Client:
        c = Client("http://testserver", world.key_a)
        c._http = httpx.Client(
            transport=httpx.WSGITransport(app=WSGIHandler()),
            base_url="http://testserver",
            headers={"Authorization": f"Bearer {world.key_a}"},
        )
        return c

    monkeypatch.setattr(cli_module, "client", in_process)
    # As Django's test client: a request's end must not close the test's connection (its
    # transaction holds the rows).
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield world
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def invoke(*args: str):
    return CliRunner().invoke(cli_module.cli, list(args), catch_exceptions=False)


def scaffolded(tmp_path: Path) -> Path:
    folder = tmp_path / "scorer"
    done = invoke("init", str(folder), "--name", "scorer")
    assert done.exit_code == 0, done.output
    return folder


def test_init_writes_a_package_that_passes_the_local_check(tmp_path):
    folder = scaffolded(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [
        "model.py",
        "requirements.txt",
        "switchyard.toml",
        "weights.json",
    ]
    assert "switchyard push scorer" in (folder / "switchyard.toml").read_text()
    assert "==" in (folder / "requirements.txt").read_text()  # the comment on pinning
    result = packaging.smoke(folder, timeout_s=60)
    assert result.ok, result.log
    assert result.report["outputs"] == {
        "score": {"datatype": "FP32", "shape": [1]},
        "label": {"datatype": "INT64", "shape": [1]},
    }
    assert not list(folder.rglob("__pycache__"))  # the check leaves the folder as it was
    # The platform's own reader takes it as packed.
    packed = packaging.pack(folder, tmp_path / "scorer.tar.gz")
    package = read_package(packed.path)
    assert package.manifest.entrypoint == "model:Model" and package.requirements == []


def test_the_scaffold_fails_a_bad_row_alone(tmp_path):
    """The scaffold's example of ``Partial``: a row with NaN fails, the others answer."""
    import numpy as np

    from switchyard_client.model import Handler

    folder = scaffolded(tmp_path)
    outputs = [{"name": "score", "datatype": "FP32"}, {"name": "label", "datatype": "INT64"}]
    handler = Handler(folder, "model:Model", outputs)
    x = np.array([[0, 0, 0, 0], [np.nan, 0, 0, 0], [1, 1, 1, 1]], dtype=np.float32)
    (score, label), errors = handler({"x": x})
    assert errors == {1: "x holds NaN or infinity"}
    assert score.shape == (3,) and score[0] == np.float32(0.5) and label.tolist()[2] == 1


def test_init_refuses_a_folder_that_already_holds_files(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "model.py").write_text("kept = True\n")
    done = CliRunner().invoke(cli_module.cli, ["init", str(tmp_path / "taken")])
    assert done.exit_code == 2 and "not an empty folder" in done.output
    assert (tmp_path / "taken" / "model.py").read_text() == "kept = True\n"


def test_pushing_the_scaffold_uploads_a_python_version(platform, tmp_path):
    folder = scaffolded(tmp_path)
    done = invoke("push", "scorer", str(folder))
    assert done.exit_code == 0, done.output
    assert "local check passed: score FP32 [1], label INT64 [1]" in done.output
    assert "pushed scorer version 1 (python)" in done.output
    assert "switchyard versions show scorer 1 --watch" in done.output
    version = ModelVersion.objects.get(model=platform.scorer)
    assert version.format == "python"
    assert version.feature_names == ["f1", "f2", "f3", "f4"]  # from the manifest
    assert [o["name"] for o in version.outputs] == ["score", "label"]
    with version.artifact.open("rb") as stored:
        package = read_package(io.BytesIO(stored.read()))
    assert sorted(m.name for m in package.members) == [
        "model.py",
        "requirements.txt",
        "switchyard.toml",
        "weights.json",
    ]


def test_a_package_that_fails_its_local_check_is_not_uploaded(platform, tmp_path):
    folder = scaffolded(tmp_path)
    model = folder / "model.py"
    model.write_text(model.read_text().replace('{"score":', '{"scores":'))  # a misnamed output
    done = CliRunner().invoke(cli_module.cli, ["push", "scorer", str(folder)])
    assert done.exit_code == 1
    assert "the local check of" in done.output and "failed" in done.output
    assert "lacks the declared outputs ['score']" in done.output
    assert "nothing was uploaded" in done.output
    assert not ModelVersion.objects.filter(model=platform.scorer).exists()


def test_a_missing_requirement_suggests_installing_it_or_no_smoke(platform, tmp_path):
    folder = scaffolded(tmp_path)
    model = folder / "model.py"
    model.write_text(
        model.read_text().replace(
            "import numpy as np\n", "import numpy as np\nimport switchyard_no_such_library\n"
        )
    )
    done = CliRunner().invoke(cli_module.cli, ["push", "scorer", str(folder)])
    assert done.exit_code == 1
    assert "ModuleNotFoundError: No module named 'switchyard_no_such_library'" in done.output
    assert "--no-smoke" in done.output and "pip install -r" in done.output
    assert not ModelVersion.objects.filter(model=platform.scorer).exists()
    # Without the local check the platform takes it (its environment build is the check).
    skipped = invoke("push", "scorer", str(folder), "--no-smoke", "--json")
    assert skipped.exit_code == 0, skipped.output
    assert json.loads(skipped.output)["format"] == "python"


def test_a_link_in_the_folder_is_refused_before_anything_runs(platform, tmp_path):
    folder = scaffolded(tmp_path)
    (tmp_path / "secret.txt").write_text("not part of the package")
    os.symlink(tmp_path / "secret.txt", folder / "data.txt")
    model = folder / "model.py"
    ran = f"import numpy as np\nopen({str(tmp_path / 'ran')!r}, 'w')\n"
    model.write_text(model.read_text().replace("import numpy as np\n", ran))
    done = CliRunner().invoke(cli_module.cli, ["push", "scorer", str(folder)])
    assert done.exit_code == 1
    assert "data.txt is a symbolic link" in done.output and "nothing was uploaded" in done.output
    assert not (tmp_path / "ran").exists()
    assert not ModelVersion.objects.filter(model=platform.scorer).exists()


def test_a_folder_without_a_manifest_is_a_usage_error(tmp_path):
    (tmp_path / "empty").mkdir()
    done = CliRunner().invoke(cli_module.cli, ["push", "scorer", str(tmp_path / "empty")])
    assert done.exit_code == 2 and "no switchyard.toml" in done.output
    wrong = CliRunner().invoke(
        cli_module.cli, ["push", "scorer", str(tmp_path / "empty"), "--format", "onnx"]
    )
    assert wrong.exit_code == 2 and "python package" in wrong.output


def test_the_archive_is_the_same_bytes_for_the_same_files_and_skips_caches(tmp_path):
    folder = scaffolded(tmp_path)
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"\0")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "data").mkdir()
    (folder / "data" / "b.bin").write_bytes(b"b" * 10)
    (folder / "data" / "a.bin").write_bytes(b"a" * 5)
    first = packaging.pack(folder, tmp_path / "one.tar.gz")
    os.utime(folder / "model.py", (1, 1))  # times do not change the bytes
    second = packaging.pack(folder, tmp_path / "two.tar.gz")
    assert first.path.read_bytes() == second.path.read_bytes()
    with tarfile.open(fileobj=gzip.open(first.path)) as tar:
        names = tar.getnames()
    assert names == [
        "data/a.bin",
        "data/b.bin",
        "model.py",
        "requirements.txt",
        "switchyard.toml",
        "weights.json",
    ]


def test_versions_show_prints_the_package_and_each_agents_state(platform, tmp_path):
    folder = scaffolded(tmp_path)
    (folder / "requirements.txt").write_text("scikit-learn==0.0.1\n")
    assert invoke("push", "scorer", str(folder), "--no-smoke").exit_code == 0
    version = ModelVersion.objects.get(model=platform.scorer)
    building, _ = create_node("cpu-1")
    failed, _ = create_node("cpu-2")
    states = {
        building: {"state": "loading", "detail": "building environment: 1 requirement"},
        failed: {"state": "failed", "detail": INSTALLER_ERROR},
    }
    for node, state in states.items():
        session = make_session(node)
        AgentSession.objects.filter(pk=session.pk).update(
            version_states={str(version.pk): {**state, "memory_bytes": 0, "provider": ""}}
        )
    done = invoke("versions", "show", "scorer", "1")
    assert done.exit_code == 0, done.output
    assert "scorer v1  python" in done.output
    assert "entrypoint model:Model; 1024 MiB, 1 CPU, 30 s per call; network off" in done.output
    assert "requirements: scikit-learn==0.0.1" in done.output
    assert "  cpu-1: loading\n    building environment: 1 requirement" in done.output
    assert "  cpu-2: failed\n    building environment failed: ERROR:" in done.output
    assert "No matching distribution found for scikit-learn==0.0.1" in done.output

    as_json = json.loads(invoke("versions", "show", "scorer", "1", "--json").output)
    assert as_json["package"]["requirements"] == ["scikit-learn==0.0.1"]
    assert {p["node"]: p["state"] for p in as_json["placements"]} == {
        "cpu-1": "loading",
        "cpu-2": "failed",
    }
    # --watch stops at once when nothing is loading any more, exit 1 for the failure.
    AgentSession.objects.filter(node=building).update(version_states={})
    watched = CliRunner().invoke(
        cli_module.cli, ["versions", "show", "scorer", "1", "--watch", "--interval", "0"]
    )
    assert watched.exit_code == 1 and "cpu-2: failed (building environment failed" in watched.output

    listed = invoke("versions", "list", "scorer")
    assert listed.output.startswith("v1\tpython\t")


def test_pushing_a_file_keeps_its_format(platform, tmp_path, onnx_bytes):
    path = tmp_path / "model.onnx"
    path.write_bytes(onnx_bytes)
    done = invoke("push", "scorer", str(path), "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["format"] == "onnx"
    shown = invoke("versions", "show", "scorer", "1")
    assert "package:" not in shown.output and "none holds it now" in shown.output


def test_pushing_a_generating_package_uploads_a_python_generator_version(platform, tmp_path):
    """A manifest saying generates = true: the local check takes a few of its strings, and the
    folder uploads as format python_generator."""
    import shutil

    from tests.python_packages import PACKAGES

    folder = tmp_path / "echo"
    shutil.copytree(PACKAGES / "word_echo", folder)
    assert packaging.package_format(folder) == packaging.PYTHON_GENERATOR_FORMAT
    done = invoke("push", "scorer", str(folder))
    assert done.exit_code == 0, done.output
    assert "local check passed: text BYTES [1]" in done.output
    assert "pushed scorer version 1 (python_generator)" in done.output
    version = ModelVersion.objects.get(model=platform.scorer)
    assert version.format == "python_generator" and version.generates_text
