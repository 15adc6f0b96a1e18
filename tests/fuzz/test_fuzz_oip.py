"""Hypothesis-generated Open Inference Protocol v2 requests, valid-ish and hostile, through the
real ASGI application: no answer is a server error, and every refusal is OIP's error shape
``{"error": "<what is wrong>"}``."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from serving_agent.protocol import OIP_TO_NUMPY
from tests.fuzz.conftest import Platform, Reply, bearer, request
from tests.fuzz.strategies import bodies, fuzz, json_values, numbers, text

JSON = (b"content-type", b"application/json")

datatypes = st.sampled_from(sorted(OIP_TO_NUMPY)) | json_values
shapes = st.lists(st.integers(min_value=-2, max_value=2**70), max_size=4) | st.sampled_from(
    [[1, 4], [2, 4], [0, 4], [4], [1] * 70]
)
tensors = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["x", "x", "y"]) | text,
        "shape": shapes | json_values,
        "datatype": st.just("FP32") | datatypes,
    },
    optional={
        "data": st.lists(numbers, max_size=10) | json_values,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(-1, 40) | numbers | json_values}
        )
        | json_values,
    },
)
documents = st.fixed_dictionaries(
    {"inputs": st.lists(tensors, min_size=1, max_size=2) | json_values},
    optional={
        "id": text | json_values,
        "outputs": st.lists(st.fixed_dictionaries({"name": st.just("y") | text | json_values}))
        | json_values,
        "parameters": st.fixed_dictionaries(
            {},
            optional={
                "priority": st.integers(-1, 5) | text | json_values,
                "timeout": numbers | json_values,
                "binary_data_output": st.booleans() | json_values,
            },
        )
        | json_values,
    },
)
# Header values as ASGI hands them (latin-1), with the digits that str.isdigit() takes.
header_values = st.text(alphabet=st.characters(max_codepoint=255), max_size=24) | st.sampled_from(
    ["0", "2", "²", "³", "99999999999999999999999", "1" * 5000, " 12 ", "-1"]
)


def assert_oip_shape(reply: Reply) -> None:
    assert reply.status < 500, (reply.status, reply.body)
    document = reply.json()
    assert isinstance(document, dict)
    if reply.status >= 400:
        assert isinstance(document["error"], str) and document["error"], document


@fuzz(300)
@given(
    body=bodies(documents), header_length=st.none() | header_values, binary=st.binary(max_size=40)
)
def test_infer_bodies_never_get_a_server_error(
    platform: Platform, body: bytes, header_length: str | None, binary: bytes
) -> None:
    headers = [bearer(platform.key), JSON]
    if header_length is not None:
        headers.append((b"inference-header-content-length", header_length.encode("latin-1")))
        body += binary
    assert_oip_shape(request("POST", "/v2/models/clf/infer", body, headers))


path_parts = (
    st.sampled_from(["clf", "versions", "1", "²", "infer", "ready", "", "..", "%00"]) | text
)


@fuzz(120)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    parts=st.lists(path_parts, max_size=5),
    version=st.none() | header_values,
)
def test_paths_methods_and_headers_never_get_a_server_error(
    platform: Platform, method: str, parts: list[str], version: str | None
) -> None:
    headers = [bearer(platform.key), JSON]
    if version is not None:
        headers.append((b"x-switchyard-timeout-ms", version.encode("latin-1")))
        headers.append((b"x-request-id", version.encode("latin-1")))
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]}
    )
    reply = request(method, "/v2/models/" + "/".join(parts), body.encode(), headers)
    assert_oip_shape(reply)


# BYTES: JSON strings (nested or not), hostile values, and binary tensors whose 4-byte
# length prefixes lie, on the ``echo`` model (string tensors in and out).
byte_elements = st.binary(max_size=12) | st.sampled_from(
    [b"\xff\xfe", b"caf\xc3\xa9", b"\xc3", b"\x00" * 5]
)
prefixes = st.integers(0, 2**32 - 1).map(lambda n: n.to_bytes(4, "little")) | st.sampled_from(
    [b"\x03\x00\x00\x00", b"\xff\xff\xff\xff"]
)
bytes_tensors = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["t", "t", "u"]) | text,
        "shape": st.sampled_from([[1], [2], [0], [3], [2, 1]]) | shapes,
        "datatype": st.just("BYTES") | datatypes,
    },
    optional={
        "data": st.lists(text | st.lists(text, max_size=2), max_size=4) | json_values,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(-1, 40) | json_values}
        ),
    },
)


@fuzz(300)
@given(
    doc=st.fixed_dictionaries(
        {"inputs": st.lists(bytes_tensors, min_size=1, max_size=2)},
        optional={"parameters": st.fixed_dictionaries({"binary_data_output": st.booleans()})},
    ),
    binary=st.lists(st.tuples(prefixes, byte_elements), max_size=4),
    header=st.booleans(),
)
def test_bytes_tensors_never_get_a_server_error(
    platform: Platform, doc: dict, binary: list[tuple[bytes, bytes]], header: bool
) -> None:
    head = json.dumps(doc).encode()
    headers = [bearer(platform.key), JSON]
    body = head
    if header:
        headers.append((b"inference-header-content-length", str(len(head)).encode()))
        body += b"".join(p + e for p, e in binary)
    reply = request("POST", "/v2/models/echo/infer", body, headers)
    if reply.headers.get("content-type") == "application/octet-stream":  # binary outputs
        assert reply.status == 200
    else:
        assert_oip_shape(reply)
