"""The hostile inputs that once reached a 500, each sent through the real ASGI application:
every one is a 4xx in its front door's own error shape, naming the problem."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from platform_site.routing import websocket_urlpatterns
from tests.fuzz.conftest import Platform, bearer, request

OIP = "/v2/models/clf/infer"
JSON = (b"content-type", b"application/json")


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def tensor(**overrides: object) -> dict:
    return {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 1, 2, 3]} | overrides


def oip_body(*inputs: dict, **extra: object) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


OIP_CASES = [
    pytest.param(b'{"inputs": ' + nested(5000) + b"}", [], "depth", id="deeply-nested-json"),
    pytest.param(oip_body(tensor(data=json.loads(nested(40)))), [], "data", id="deep-data"),
    pytest.param(oip_body(tensor(shape=[2**62, 2**62], data=[])), [], "shape", id="shape-wraps"),
    pytest.param(oip_body(tensor(shape=[2**70], data=[])), [], "shape", id="shape-over-int64"),
    pytest.param(oip_body(tensor(shape=[1] * 70)), [], "shape", id="shape-too-many-dims"),
    pytest.param(oip_body(tensor(datatype=["FP32"])), [], "datatype", id="list-datatype"),
    pytest.param(oip_body(tensor(datatype={"a": 1})), [], "datatype", id="dict-datatype"),
    pytest.param(
        b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", '
        b'"data": [1e400, 0, 0, 0]}]}',
        [],
        "infinity",
        id="number-1e400",
    ),
    pytest.param(
        b'{"id": "\\ud800", "inputs": ' + json.dumps([tensor()]).encode() + b"}",
        [],
        "surrogate",
        id="lone-surrogate-id",
    ),
    pytest.param(
        b'{"inputs": [{"name": "\\udfff", "shape": [1], "datatype": "FP32", "data": [1]}]}',
        [],
        "surrogate",
        id="lone-surrogate-name",
    ),
    pytest.param(
        oip_body(tensor()),
        [(b"inference-header-content-length", "²".encode("latin-1"))],
        "Inference-Header-Content-Length",
        id="superscript-digit-header-length",
    ),
    pytest.param(
        oip_body(tensor(data=None, parameters={"binary_data_size": 16.0})) + b"\0" * 16,
        [
            (
                b"inference-header-content-length",
                str(
                    len(oip_body(tensor(data=None, parameters={"binary_data_size": 16.0})))
                ).encode(),
            )
        ],
        "binary_data_size",
        id="float-binary-size",
    ),
    pytest.param(
        oip_body(tensor(shape=[0, 4], data=None, parameters={"binary_data_size": 0})),
        [(b"inference-header-content-length", b"999999999999999999999")],
        "Inference-Header-Content-Length",
        id="binary-offset-out-of-range",
    ),
    pytest.param(
        oip_body(tensor(), parameters={"priority": [1]}), [], "priority", id="list-priority"
    ),
    pytest.param(oip_body(tensor(), outputs=[{"name": ["y"]}]), [], "outputs", id="list-output"),
]


@pytest.mark.parametrize("body, headers, words", OIP_CASES)
def test_oip_answers_hostile_bodies_with_400_naming_the_problem(
    platform: Platform, body: bytes, headers: list, words: str
) -> None:
    reply = request("POST", OIP, body, [bearer(platform.key), JSON, *headers])
    assert reply.status == 400, reply.body
    error = reply.json()
    assert isinstance(error, dict) and words.lower() in error["error"].lower(), error
    assert platform.agent.requests == []


@pytest.mark.parametrize(
    "path, words",
    [
        ("/v2/models/clf/versions/²/infer", "version"),
        ("/v2/models/clf/versions/٣/infer", "version"),
    ],
)
def test_oip_refuses_a_version_that_is_not_an_ascii_number(
    platform: Platform, path: str, words: str
) -> None:
    reply = request("POST", path, oip_body(tensor()), [bearer(platform.key), JSON])
    assert reply.status in (400, 404), reply.body
    assert words in reply.json()["error"]


def test_oip_refuses_a_non_ascii_content_length(platform: Platform) -> None:
    headers = [bearer(platform.key), JSON, (b"content-length", "³".encode("latin-1"))]
    reply = request("POST", OIP, oip_body(tensor()), headers)
    assert reply.status == 400 and "Content-Length" in reply.json()["error"]


def test_a_good_request_is_answered(platform: Platform) -> None:
    reply = request("POST", OIP, oip_body(tensor()), [bearer(platform.key), JSON])
    assert reply.status == 200, reply.body


@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"model": "clf", "prompt": ' + nested(5000) + b"}", "depth"),
        (b'{"model": "clf", "prompt": "\\ud800"}', "surrogate"),
        (b'{"model": "clf", "prompt": "x", "temperature": NaN}', "JSON"),
        (b'{"model": "clf", "prompt": "x", "max_tokens": 1e400}', "JSON"),
        (b'{"model": "clf", "prompt": "x", "priority": [' + b"1," * 9999 + b"1]}", "priority:"),
        (b'{"model": "clf", "prompt": "x", "priority": 1e308}', "priority:"),
    ],
)
def test_openai_answers_hostile_bodies_with_an_openai_shaped_400(
    platform: Platform, body: bytes, words: str
) -> None:
    reply = request("POST", "/v1/completions", body, [bearer(platform.key), JSON])
    assert reply.status == 400 and reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error


def test_openai_unknown_routes_get_an_openai_shaped_404(platform: Platform) -> None:
    reply = request("POST", "/v1/audio/speech", b"{}", [bearer(platform.key), JSON])
    assert reply.status == 404 and reply.json()["error"]["message"]


def test_a_model_name_no_model_can_have_is_404_not_a_database_error(platform: Platform) -> None:
    path = "/v2/models/cl\x00f/infer"
    reply = request("POST", path, oip_body(tensor()), [bearer(platform.key), JSON])
    assert reply.status == 404 and "not found" in reply.json()["error"]


def test_the_generation_socket_answers_a_deeply_nested_frame_and_stays_open(
    platform: Platform,
) -> None:
    async def scenario() -> list[dict]:
        headers = [bearer(platform.key)]
        socket = WebsocketCommunicator(
            URLRouter(websocket_urlpatterns), "/ws/v1/models/clf/generate", headers=headers
        )
        assert (await socket.connect())[0]
        answers = []
        for frame in (nested(5000).decode(), '{"type": "generate", "id": "\\ud800"}', "{}"):
            await socket.send_to(text_data=frame)
            answers.append(await socket.receive_json_from(timeout=5))
        await socket.disconnect()
        return answers

    nesting, surrogate, empty = async_to_sync(scenario)()
    assert nesting["code"] == "bad_request" and "depth" in nesting["message"]
    assert surrogate["code"] == "bad_request" and "surrogate" in surrogate["message"]
    assert empty["code"] == "bad_request"  # and the socket was still open to answer it
