"""The `switchyard` CLI (and so the SDK under it) against a real server and agent."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from tests.e2e.harness import (
    create_node,
    embedded_backend,
    free_port,
    start_agent,
    start_server,
    wait_until,
)
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    backend = embedded_backend(tmp_path_factory.mktemp("cli"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(backend, "uvicorn", port)
    agent = start_agent(backend, url, create_node(backend, "n"))
    try:
        # keys need the admin scope, which create_tenant's engineer key lacks
        args = ["--owner", "alpha-engineer", "--scopes", "predict,deploy,admin", "--json"]
        yield url, json.loads(backend.manage("create_tenant", "alpha", *args))["api_key"]
    finally:
        agent.stop()
        server.stop()
        backend.close()


def run(config_home, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "XDG_CONFIG_HOME": str(config_home), **(env or {})}
    environment.pop("SWITCHYARD_URL", None)
    environment.pop("SWITCHYARD_KEY", None)
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "switchyard_client.cli", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
    )


def test_cli_end_to_end(platform, tmp_path):
    url, key = platform
    home = tmp_path / "config"
    logged = run(home, "login", "--url", url, "--key", key)
    assert logged.returncode == 0, logged.stderr
    config = home / "switchyard" / "config.json"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600

    created = run(home, "models", "create", "clf", "--json")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["name"] == "clf"
    listed = json.loads(run(home, "models", "list", "--json").stdout)
    assert [m["name"] for m in listed] == ["clf"]

    artifact = small_onnx()
    path = tmp_path / "model.onnx"
    path.write_bytes(artifact)
    pushed = run(home, "push", "clf", str(path), "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["version"] == 1

    moved = run(home, "alias", "set", "clf", "production", "1", "--json")
    assert moved.returncode == 0, moved.stderr
    assert json.loads(moved.stdout)["version"] == 1

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
        wait_until(lambda: http.get("/v2/models/clf/ready").status_code == 200, 30)
    rows = [[0.1, 0.2, 0.3, 0.4], [1.0, -1.0, 0.5, 2.0]]
    request = {
        "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": sum(rows, [])}]
    }
    (tmp_path / "req.json").write_text(json.dumps(request))
    answered = run(home, "predict", "clf", "--input", f"@{tmp_path / 'req.json'}", "--json")
    assert answered.returncode == 0, answered.stderr
    got = np.array(json.loads(answered.stdout)["outputs"][0]["data"], dtype=np.float32)
    session = ort.InferenceSession(artifact)
    feed = {session.get_inputs()[0].name: np.array(rows, dtype=np.float32)}
    expected = session.run(None, feed)[0]
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-6)

    made = run(home, "keys", "create", "reader", "--json")
    assert made.returncode == 0, made.stderr
    new_key = json.loads(made.stdout)
    assert new_key["key"]
    revoked = run(home, "keys", "revoke", str(new_key["id"]), "--json")
    assert revoked.returncode == 0, revoked.stderr
    dead = run(
        home, "models", "list", env={"SWITCHYARD_URL": url, "SWITCHYARD_KEY": new_key["key"]}
    )
    assert dead.returncode == 1
    assert dead.stderr.startswith("error: 401") or dead.stderr.startswith("error: 403")


def test_bad_key_exits_1_with_the_server_message(platform, tmp_path):
    url, _ = platform
    refused = run(tmp_path, "login", "--url", url, "--key", "sy_not_a_key")
    assert refused.returncode == 1
    assert "error: 40" in refused.stderr and len(refused.stderr.strip()) > len("error: 401: ")
    assert not (tmp_path / "switchyard" / "config.json").exists()


def test_usage_errors_exit_2(tmp_path):
    assert run(tmp_path, "models", "list").returncode == 2  # not logged in
    assert run(tmp_path, "no-such-command").returncode == 2
