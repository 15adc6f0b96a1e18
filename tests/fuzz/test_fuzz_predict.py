"""Hypothesis-generated bodies for the prediction API (``POST /api/v1/models/{name}/predict``)
through its lean ASGI app: no answer is a server error, each status is one the OpenAPI schema
documents for the operation, and each refusal is the API's error shape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from tests.fuzz.conftest import Platform, bearer, request
from tests.fuzz.strategies import bodies, fuzz, json_values, numbers, text

rows = st.lists(numbers, min_size=0, max_size=5) | st.dictionaries(text, numbers, max_size=4)
documents = st.fixed_dictionaries(
    {},
    optional={
        "instances": st.lists(rows | json_values, max_size=3) | json_values,
        "inputs": st.dictionaries(st.just("x") | text, st.lists(rows, max_size=2) | json_values)
        | json_values,
        "outputs": st.lists(st.just("y") | text, max_size=2) | json_values,
        "parameters": st.fixed_dictionaries(
            {},
            optional={
                "priority": st.sampled_from(["critical", "batch", 0, 1, 5, "asap"]) | json_values,
                "timeout": numbers | json_values,
            },
        )
        | st.dictionaries(text, json_values, max_size=2)
        | json_values,
    },
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/merge-patch+json",
        "text/plain",
        "",
        "application/json; charset=latin-1",
    ]
)


@pytest.fixture
def documented(platform: Platform) -> set[int]:
    """The statuses the schema documents for the operation."""
    schema = APIClient(HTTP_AUTHORIZATION=f"Bearer {platform.key}").get(
        "/api/schema/", HTTP_ACCEPT="application/json"
    )
    operation = schema.json()["paths"]["/api/v1/models/{name}/predict"]["post"]
    return {int(status) for status in operation["responses"]}


@fuzz(200)
@given(
    body=bodies(documents),
    content_type=content_types,
    name=st.sampled_from(["clf", "clf", "nope", "CLF", "clf\n", "a" * 200]),
)
def test_predict_bodies_never_get_a_server_error(
    platform: Platform, documented: set[int], body: bytes, content_type: str, name: str
) -> None:
    headers = [bearer(platform.key), (b"content-type", content_type.encode())]
    reply = request("POST", f"/api/v1/models/{name}/predict", body, headers)
    assert reply.status < 500 and reply.status in documented, (reply.status, reply.body)
    document = reply.json()
    assert isinstance(document, dict)
    if reply.status >= 400:
        assert isinstance(document["error"], str) and document["error"], document
