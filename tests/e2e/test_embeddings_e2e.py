"""MiniLM-L6 end to end: its ONNX export uploaded with its tokenizer, served by a real agent,
answers OpenAI's /v1/embeddings (the openai SDK, float and base64) and OIP v2 with BYTES text
input (REST JSON, tritonclient's binary HTTP and gRPC) with the vectors sentence-transformers
computes in this process; hostile text gets a 400 naming the input."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tokenizers import Tokenizer

from platform_site.demo import minilm
from tests.onnx_models import echo_onnx, small_onnx

from .conftest import make_backend, upload_and_promote, wait_ready
from .harness import create_node, create_tenant, free_port, start_agent, start_server

pytestmark = pytest.mark.e2e

TEXTS = [
    "Switchyard serves embeddings.",
    "A sentence about trains, tracks and the switches between them.",
    "Noch ein Satz: Grüße aus Zürich!",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm.model_dir()), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True)


# One backend: what differs between them (the database, the channel layer) is not on this path,
# and loading MiniLM twice would double the module's time.
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    backend = make_backend("embedded", tmp_path_factory.mktemp("embedded"))
    port, grpc_port = free_port(), free_port()
    server = start_server(backend, "uvicorn", port, grpc_port=grpc_port)
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(backend, url, create_node(backend, "node-1"))
    key = create_tenant(backend, "alpha")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        created = c.post("/api/v1/models", json={"name": "minilm", "task": "embedding"})
        assert created.status_code == 201, created.text
        files = {
            "artifact": ("model.onnx", minilm.exported().read_bytes(), "application/octet-stream"),
            "tokenizer": ("tokenizer.json", minilm.tokenizer_path().read_bytes(), "text/json"),
        }
        version = c.post("/api/v1/models/minilm/versions", files=files)
        assert version.status_code == 201, version.text
        moved = c.put("/api/v1/models/minilm/aliases/production", json={"version": 1})
        assert moved.status_code == 200, moved.text
        upload_and_promote(c, "clf", small_onnx())
        upload_and_promote(c, "echo", echo_onnx())  # string tensors in and out
        wait_ready(c, "minilm", timeout=60, proc=agent)
        wait_ready(c, "clf", proc=agent)
        wait_ready(c, "echo", proc=agent)
    other = create_tenant(backend, "beta")
    yield {"url": url, "grpc": f"127.0.0.1:{grpc_port}", "key": key, "other_key": other}
    agent.stop()
    server.stop()
    backend.close()


def close(got: np.ndarray, reference: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    np.testing.assert_allclose(got, reference, atol=1e-4)
    cosine = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, 1)
    assert (cosine > 0.999).all(), cosine


def test_openai_sdk_embeddings_match_sentence_transformers(served, reference):
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key=served["key"])
    # Without encoding_format the SDK asks for base64 and decodes it; "float" is the JSON list.
    answer = client.embeddings.create(model="minilm", input=TEXTS)
    close(np.array([d.embedding for d in answer.data]), reference)
    answer = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    close(np.array([d.embedding for d in answer.data]), reference)
    assert [d.index for d in answer.data] == [0, 1, 2]
    # Asked for explicitly, base64 comes back as sent: little-endian float32 bytes.
    raw = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in raw.data]
    close(np.array(decoded), reference)
    tokenizer = Tokenizer.from_file(str(minilm.tokenizer_path()))
    tokenizer.no_padding()
    tokens = sum(len(tokenizer.encode(t).ids) for t in TEXTS)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens
    one = client.embeddings.create(model="minilm@production", input=TEXTS[1], dimensions=384)
    close(np.array([one.data[0].embedding]), reference[1:2])


def test_openai_refusals_say_what_is_wrong(served):
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key=served["key"])
    with pytest.raises(openai.BadRequestError, match="cannot shorten them"):
        client.embeddings.create(model="minilm", input="hi", dimensions=128)
    with pytest.raises(openai.BadRequestError, match="is a classifier model"):
        client.embeddings.create(model="clf", input="hi")
    with pytest.raises(openai.BadRequestError, match="token arrays are not supported"):
        client.embeddings.create(model="minilm", input=[[101, 102]])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nothing", input="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served["url"] + "/v1", api_key="sy_wrong").embeddings.create(
            model="minilm", input="hi"
        )
    # Another tenant's key does not see this tenant's model.
    other = openai.OpenAI(base_url=served["url"] + "/v1", api_key=served["other_key"])
    with pytest.raises(openai.NotFoundError):
        other.embeddings.create(model="minilm", input="hi")


def test_oip_rest_json_text_in_vectors_out(served, reference):
    body = {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": TEXTS}]}
    reply = httpx.post(
        served["url"] + "/v2/models/minilm/infer",
        json=body,
        headers={"Authorization": f"Bearer {served['key']}"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    outputs = {o["name"]: o for o in reply.json()["outputs"]}
    vectors = outputs["sentence_embedding"]
    assert vectors["shape"] == [3, 384]
    close(np.array(vectors["data"]).reshape(3, 384), reference)
    assert outputs["token_count"]["datatype"] == "INT64"


def test_tritonclient_http_and_grpc_send_bytes_unchanged(served, reference):
    headers = {"Authorization": f"Bearer {served['key']}"}
    texts = np.array([t.encode() for t in TEXTS], dtype=np.object_)
    given = triton_http.InferInput("text", [3], "BYTES")
    given.set_data_from_numpy(texts, binary_data=True)
    host = served["url"].removeprefix("http://")
    with triton_http.InferenceServerClient(host) as client:
        result = client.infer("minilm", [given], headers=headers)
    close(result.as_numpy("sentence_embedding"), reference)
    given = triton_grpc.InferInput("text", [3], "BYTES")
    given.set_data_from_numpy(texts)
    with triton_grpc.InferenceServerClient(served["grpc"]) as client:
        result = client.infer(
            "minilm", [given], headers={"authorization": headers["Authorization"]}
        )
    close(result.as_numpy("sentence_embedding"), reference)


def test_tritonclient_receives_bytes_outputs_unchanged(served):
    """A model's string outputs (as a classifier's labels) through a real agent: object arrays
    of bytes on both tritonclient transports, non-ASCII included."""
    auth = f"Bearer {served['key']}"
    texts = np.array([b"cat", "dög".encode(), b""], dtype=np.object_)
    given = triton_http.InferInput("t", [3], "BYTES")
    given.set_data_from_numpy(texts, binary_data=True)
    wanted = triton_http.InferRequestedOutput("u", binary_data=True)
    host = served["url"].removeprefix("http://")
    with triton_http.InferenceServerClient(host) as client:
        result = client.infer("echo", [given], outputs=[wanted], headers={"Authorization": auth})
    assert result.as_numpy("u").tolist() == texts.tolist()
    given = triton_grpc.InferInput("t", [3], "BYTES")
    given.set_data_from_numpy(texts)
    with triton_grpc.InferenceServerClient(served["grpc"]) as client:
        result = client.infer("echo", [given], headers={"authorization": auth})
    got = result.as_numpy("u")
    assert got.dtype == np.object_ and got.tolist() == texts.tolist()


def binary_request(served, elements: bytes, count: int) -> httpx.Response:
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "shape": [count],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(elements)},
                }
            ]
        }
    ).encode()
    return httpx.post(
        served["url"] + "/v2/models/minilm/infer",
        content=head + elements,
        headers={
            "Authorization": f"Bearer {served['key']}",
            "Inference-Header-Content-Length": str(len(head)),
        },
        timeout=30,
    )


@pytest.mark.parametrize(
    ("elements", "count", "message"),
    [
        (b"\x02\x00\x00\x00\xc3(", 1, "element 0 is not valid UTF-8 text"),
        (b"\xff\xff\xff\x7fabc", 1, "element 0 declares 2147483647 bytes"),
        (b"\x01\x00\x00\x00a", 3, "3 elements need at least 12 bytes"),
        (b"\x01\x00\x01\x00" + b"a" * 65537, 1, "element 0 has 65537 bytes; the limit is"),
    ],
)
def test_hostile_bytes_are_400_naming_the_input(served, elements, count, message):
    reply = binary_request(served, elements, count)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"] and "('text')" in reply.json()["error"]
