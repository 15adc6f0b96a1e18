"""The ``python`` format with real processes: packages uploaded through the API, their
environments built by a real agent (from the package index, wheels only), their code run in
sandboxed workers, and every answer read through stock tritonclient (HTTP and gRPC) and the
prediction API.

- a tokenizer in ``preprocess`` and an ONNX graph in ``predict`` answer what the same steps give
  run by hand;
- a package depending on a library the agent lacks (``roman``) serves, with per-row errors;
- a package whose requirement does not exist fails its load with the installer's error;
- a hostile package's attacks (the environment, the node token, a fork bomb, 10 GiB, a sleep
  forever, writes outside its scratch folder, the network, a crash, a raise) are each contained
  and reported, and the agent keeps serving its other versions after each.

One platform, on the embedded backend: the format runs on the agent, and requests take the
same gateway path on both backends (the other e2e modules cover those).
"""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.onnx_models import small_onnx
from tests.python_packages import PACKAGES, pack, text_scores_by_hand, text_scores_package

from .conftest import make_backend, upload_and_promote
from .harness import (
    create_node,
    create_tenant,
    free_port,
    start_agent,
    start_celery,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.e2e

STATES = """
import json
from fleet.models import AgentSession
session = AgentSession.objects.filter(disconnected_at__isnull=True).latest("pk")
print(json.dumps(session.version_states))
"""
# Environments come from the package index (onnxruntime is ~17 MB on a first build).
BUILD_TIMEOUT_S = 300


class Platform:
    def __init__(self, url: str, grpc: str, key: str, token: str, package, backend, agent, port):
        self.url, self.grpc, self.key, self.token = url, grpc, key, token
        self.package, self.backend, self.agent, self.port = package, backend, agent, port
        self.headers = {"Authorization": f"Bearer {key}"}

    def auth(self) -> dict[str, str]:
        """Headers for one tritonclient call (it adds its own to the dict it is given)."""
        return dict(self.headers)

    def http(self) -> triton_http.InferenceServerClient:
        # (infer's own ``timeout`` is a deadline in microseconds sent to the server.)
        return triton_http.InferenceServerClient(
            self.url.removeprefix("http://"), network_timeout=60
        )

    def states(self) -> dict[str, dict]:
        return json.loads(self.backend.shell(STATES))


def upload(client: httpx.Client, name: str, archive: bytes) -> dict:
    created = client.post("/api/v1/models", json={"name": name, "task": "classifier"})
    assert created.status_code == 201, created.text
    files = {"artifact": (f"{name}.tar.gz", archive, "application/gzip")}
    version = client.post(f"/api/v1/models/{name}/versions", files=files, data={"format": "python"})
    assert version.status_code == 201, version.text
    moved = client.put(f"/api/v1/models/{name}/aliases/production", json={"version": 1})
    assert moved.status_code == 200, moved.text
    return version.json()


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("python")
    backend = make_backend("embedded", tmp)
    backend.env["SWITCHYARD_SANDBOX_DIR"] = str(tmp / "sandbox")
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    backend.env["SWITCHYARD_PLATFORM_URL"] = url  # batch jobs call the front door here
    server = start_server(backend, "uvicorn", port, grpc_port=grpc_port)
    token = create_node(backend, "node-1")
    agent = start_agent(backend, url, token)
    worker = start_celery(backend, "worker")
    key = create_tenant(backend, "alpha")
    package = text_scores_package(tmp / "text_scores")
    platform = Platform(url, f"127.0.0.1:{grpc_port}", key, token, package, backend, agent, port)
    broken = tmp / "broken"
    broken.mkdir()
    for name in ("switchyard.toml", "numerals.py"):
        (broken / name).write_bytes((PACKAGES / "roman_numerals" / name).read_bytes())
    (broken / "requirements.txt").write_text("switchyard-no-such-package-anywhere==9.9.9\n")
    try:
        with httpx.Client(base_url=url, headers=platform.headers, timeout=60) as client:
            upload(client, "text", pack(package, root="text_scores"))
            upload(client, "roman", pack(PACKAGES / "roman_numerals"))
            upload(client, "hostile", pack(PACKAGES / "hostile"))
            upload(client, "broken", pack(broken))
            upload_and_promote(client, "clf", small_onnx())
            for name in ("text", "roman", "hostile", "clf"):
                wait_until(
                    lambda n=name: client.get(f"/v2/models/{n}/ready").status_code == 200,
                    BUILD_TIMEOUT_S,
                    agent,
                )
        yield platform
    finally:
        worker.stop()
        agent.stop()
        server.stop()
        backend.close()


def text_input(texts: list[str]) -> triton_http.InferInput:
    tensor = triton_http.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


TEXTS = ["great model and fast", "awful slow queue", "words it never saw", ""]


def test_a_tokenizer_and_an_onnx_graph_answer_like_the_same_steps_by_hand(platform):
    result = platform.http().infer("text", [text_input(TEXTS)], headers=platform.auth())
    want = text_scores_by_hand(platform.package, TEXTS)
    np.testing.assert_allclose(result.as_numpy("scores"), want, rtol=1e-6, atol=1e-6)
    labels = [b"negative", b"positive"]
    assert list(result.as_numpy("label")) == [labels[i] for i in want.argmax(axis=1)]


def test_concurrent_requests_batched_together_each_get_their_own_rows(platform):
    from concurrent.futures import ThreadPoolExecutor

    groups = [TEXTS[i:] for i in range(4)] * 3
    client = platform.http()

    def ask(texts):
        return platform.http().infer("text", [text_input(texts)], headers=platform.auth())

    with ThreadPoolExecutor(len(groups)) as pool:
        results = list(pool.map(ask, groups))
    for texts, result in zip(groups, results, strict=True):
        np.testing.assert_allclose(
            result.as_numpy("scores"), text_scores_by_hand(platform.package, texts), atol=1e-6
        )
    client.close()


def test_the_same_package_over_grpc_and_the_prediction_api(platform):
    grpc = triton_grpc.InferenceServerClient(platform.grpc)
    tensor = triton_grpc.InferInput("text", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([b"great", b"awful"], dtype=object))
    metadata = [("authorization", f"Bearer {platform.key}")]
    got = grpc.infer("text", [tensor], headers=dict(metadata)).as_numpy("scores")
    np.testing.assert_allclose(got, text_scores_by_hand(platform.package, ["great", "awful"]))
    with httpx.Client(base_url=platform.url, headers=platform.headers) as client:
        answer = client.post("/api/v1/models/text/predict", json={"instances": [{"text": "great"}]})
        meta = client.get("/v2/models/text").json()
    assert answer.status_code == 200, answer.text
    assert meta["platform"] == "switchyard_python"


def test_a_batch_job_answers_every_row_like_the_steps_by_hand(platform):
    rows = [json.dumps({"text": text}) for text in TEXTS * 5]
    files = {"file": ("rows.jsonl", "\n".join(rows).encode(), "application/x-ndjson")}
    with httpx.Client(base_url=platform.url, headers=platform.headers, timeout=30) as client:
        job = client.post("/api/v1/jobs", data={"model": "text", "format": "jsonl"}, files=files)
        assert job.status_code == 201, job.text
        url = f"/api/v1/jobs/{job.json()['id']}"
        wait_until(lambda: client.get(url).json()["state"] == "succeeded", 60, platform.agent)
        lines = [json.loads(line) for line in client.get(f"{url}/output").text.splitlines()]
    assert sorted(line["row"] for line in lines) == list(range(len(rows)))
    want = text_scores_by_hand(platform.package, TEXTS * 5)
    for line in lines:
        got = np.asarray(line["outputs"]["scores"]).reshape(2)
        np.testing.assert_allclose(got, want[line["row"]], atol=1e-6)


def test_a_library_the_agent_lacks_serves_with_per_row_errors(platform):
    number = triton_http.InferInput("number", [3], "INT64")
    number.set_data_from_numpy(np.array([1994, 4, 2024], dtype=np.int64))
    result = platform.http().infer("roman", [number], headers=platform.auth())
    assert list(result.as_numpy("numeral")) == [b"MCMXCIV", b"IV", b"MMXXIV"]
    # A row the library refuses fails the request that holds it, with the library's message.
    number = triton_http.InferInput("number", [1], "INT64")
    number.set_data_from_numpy(np.array([5000], dtype=np.int64))
    with pytest.raises(InferenceServerException) as refused:
        platform.http().infer("roman", [number], headers=platform.auth())
    assert refused.value.status() == "400" and "number out of range" in refused.value.message()


def test_a_requirement_that_does_not_exist_fails_the_load_with_the_installers_error(platform):
    def failed() -> dict | None:
        states = [s for s in platform.states().values() if s["state"] == "failed"]
        return states[0] if states else None

    wait_until(lambda: failed() is not None, BUILD_TIMEOUT_S, platform.agent)
    detail = failed()["detail"]
    assert "switchyard-no-such-package-anywhere" in detail, detail
    with httpx.Client(base_url=platform.url, headers=platform.headers) as client:
        assert client.get("/v2/models/broken/ready").status_code != 200


def attack(platform, action: int, argument: str = "") -> str | InferenceServerException:
    tensors = [
        triton_http.InferInput("action", [1], "INT64"),
        triton_http.InferInput("argument", [1], "BYTES"),
    ]
    tensors[0].set_data_from_numpy(np.array([action], dtype=np.int64))
    tensors[1].set_data_from_numpy(np.array([argument.encode()], dtype=object))
    try:
        result = platform.http().infer("hostile", tensors, headers=platform.auth())
    except InferenceServerException as exc:
        return exc
    return result.as_numpy("report")[0].decode()


def still_serving(platform) -> None:
    """The agent's other versions answer, and so does the hostile one (its worker restarted)."""
    result = platform.http().infer("text", [text_input(["fast"])], headers=platform.auth())
    assert result.as_numpy("scores").shape == (1, 2)
    with httpx.Client(base_url=platform.url, headers=platform.headers) as client:
        body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]}
        assert client.post("/v2/models/clf/infer", json=body).status_code == 200
    wait_until(lambda: attack(platform, 0) == "ok", 30, platform.agent)


def test_the_worker_sees_no_credentials_of_the_platform(platform):
    names = attack(platform, 1).split()
    assert not [n for n in names if n.startswith(("SWITCHYARD", "DATABASE", "REDIS", "DJANGO"))]
    hunted = attack(platform, 2, platform.token)
    assert hunted == "not found", getattr(hunted, "message", lambda: hunted)()
    assert attack(platform, 2, platform.key) == "not found"


def test_writes_land_in_the_scratch_folder_only(platform):
    outside = [str(platform.package.parent), "/etc", "/usr/lib", os.getcwd(), "/tmp"]
    report = attack(platform, 6, ",".join(outside))
    for folder in outside[:-1]:
        assert f"refused {folder}/hostile-was-here" in report, report
        assert not os.path.exists(f"{folder}/hostile-was-here")
    # /tmp is the worker's own (a fresh tmpfs): written there, never on the node's /tmp.
    assert "wrote /tmp/hostile-was-here" in report
    assert not os.path.exists("/tmp/hostile-was-here")


def test_no_network_unless_the_policy_allows_it(platform):
    report = attack(platform, 7, f"127.0.0.1:{platform.port}")
    assert report.startswith("refused"), report


@pytest.mark.parametrize(
    ("action", "status", "reason"),
    [
        (9, "500", "ValueError: the handler raised on purpose"),
        (8, "500", "exited with status 3"),
        (5, "500", "did not finish within the package's 5 s"),
        (4, "500", "memory"),
    ],
    ids=["raises", "crashes", "hangs", "allocates-10GiB"],
)
def test_a_failing_handler_fails_its_request_and_the_agent_keeps_serving(
    platform, action, status, reason
):
    failure = attack(platform, action)
    assert isinstance(failure, InferenceServerException), failure
    assert failure.status() == status and reason in failure.message(), failure.message()
    assert "Traceback" not in failure.message()
    still_serving(platform)


def test_a_fork_bomb_stops_at_the_process_limit(platform):
    report = attack(platform, 3)
    assert report.startswith("forks stopped after"), report
    assert int(report.split()[3].rstrip(":")) < 100
    still_serving(platform)
