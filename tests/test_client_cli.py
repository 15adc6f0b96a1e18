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


def test_cli_rollouts_key_rotation_and_greedy_generation(platform, tmp_path):
    from tests.e2e.test_streaming_e2e import textgen_artifact

    url, key = platform
    home = tmp_path / "config"
    assert run(home, "login", "--url", url, "--key", key).returncode == 0

    # A canary on a model of its own: start, show, kill.
    assert run(home, "models", "create", "ranker").returncode == 0
    path = tmp_path / "m.onnx"
    path.write_bytes(small_onnx())
    for _ in range(2):
        pushed = run(home, "push", "ranker", str(path), "--json")
        assert pushed.returncode == 0, pushed.stderr
    assert run(home, "alias", "set", "ranker", "production", "1").returncode == 0
    guardrails = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}
    plan = json.dumps({"mode": "canary", "weight": 5, "guardrails": guardrails})
    started = run(home, "rollout", "start", "ranker", "2", "--plan", plan, "--json")
    assert started.returncode == 0, started.stderr
    plan_id = json.loads(started.stdout)["id"]
    shown = json.loads(run(home, "rollout", "show", str(plan_id), "--json").stdout)
    assert (shown["state"], shown["baseline"], shown["candidate"], shown["weight"]) == (
        "running",
        1,
        2,
        5,
    )
    killed = run(home, "rollout", "kill", str(plan_id), "--json")
    assert killed.returncode == 0, killed.stderr
    assert json.loads(killed.stdout)["state"] == "rolled_back"
    again = run(home, "rollout", "kill", str(plan_id))  # the server's refusal, exit 1
    assert again.returncode == 1 and again.stderr.startswith("error: 4")

    # Rotation: both keys work during the overlap; without one the old key stops at once.
    def works(secret: str) -> bool:  # authenticated (a predict-only key may be refused 403)
        listed = run(
            tmp_path, "models", "list", env={"SWITCHYARD_URL": url, "SWITCHYARD_KEY": secret}
        )
        return not listed.stderr.startswith("error: 401")

    made = json.loads(run(home, "keys", "create", "app", "--json").stdout)
    rotated = run(home, "keys", "rotate", str(made["id"]), "--overlap-s", "60", "--json")
    assert rotated.returncode == 0, rotated.stderr
    second = json.loads(rotated.stdout)
    assert second["key"] != made["key"] and works(made["key"]) and works(second["key"])
    third = json.loads(
        run(home, "keys", "rotate", str(second["id"]), "--overlap-s", "0", "--json").stdout
    )
    assert works(third["key"]) and not works(second["key"])

    # A generation streamed by the CLI is the server's greedy completion, token for token.
    assert run(home, "models", "create", "gen", "--task", "generator").returncode == 0
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(textgen_artifact())
    pushed = run(home, "push", "gen", str(weights), "--format", "textgen", "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert run(home, "alias", "set", "gen", "production", "1").returncode == 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
        wait_until(lambda: http.get("/v2/models/gen/ready").status_code == 200, 60)
        body = {"model": "gen", "prompt": "once", "max_tokens": 12, "temperature": 0}
        reference = http.post("/v1/completions", json=body, timeout=60).json()
    streamed = run(home, "generate", "gen", "once", "--max-tokens", "12", "--temperature", "0")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == reference["choices"][0]["text"] + "\n"
    assert 0 < reference["usage"]["completion_tokens"] <= 12
