"""Hypothesis-generated OpenAI request bodies (completions, chat completions, embeddings)
through the real ASGI application: no answer is a server error, and every answer is JSON in
OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``, never an HTML page."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import Platform, bearer, request
from tests.fuzz.strategies import bodies, fuzz, json_values, numbers, text

sampling = {
    "max_tokens": st.integers(-1, 2**64) | numbers | json_values,
    "temperature": numbers | json_values,
    "top_p": numbers | json_values,
    "stop": text | st.lists(text, max_size=6) | json_values,
    "stream": st.booleans() | json_values,
    "seed": st.integers(-1, 2**70) | json_values,
    "user": text | json_values,
    "n": st.integers(0, 3) | json_values,
}
model = st.sampled_from(["clf", "writer", ""]) | text | json_values
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | json_values},
        optional={"content": text | json_values},
    )
    | json_values,
    max_size=3,
)
completion = st.fixed_dictionaries(
    {"model": model}, optional={"prompt": text | json_values, **sampling}
)
chat = st.fixed_dictionaries(
    {"model": model}, optional={"messages": messages | json_values, **sampling}
)
embedding = st.fixed_dictionaries(
    {"model": model | st.just("echo")},
    optional={
        "input": text | st.lists(text | st.lists(st.integers(-1, 2**40)), max_size=3) | json_values,
        "encoding_format": st.sampled_from(["float", "base64", "int8"]) | json_values,
        "dimensions": st.integers(-1, 2**70) | json_values,
    },
)
routes = st.sampled_from(
    [
        ("/v1/completions", completion),
        ("/v1/chat/completions", chat),
        ("/v1/embeddings", embedding),
    ]
)


@fuzz(250)
@given(data=st.data(), method=st.sampled_from(["POST", "POST", "POST", "GET"]))
def test_openai_bodies_never_get_a_server_error_or_an_html_page(
    platform: Platform, data: st.DataObject, method: str
) -> None:
    path, documents = data.draw(routes)
    body = data.draw(bodies(documents))
    headers = [bearer(platform.key), (b"content-type", b"application/json")]
    reply = request(method, path, body, headers)
    assert reply.status < 500, (reply.status, reply.body)
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    document = reply.json()
    assert isinstance(document, dict)
    if reply.status >= 400:
        error = document["error"]
        assert isinstance(error["message"], str) and error["message"], document
        assert set(error) == {"message", "type", "param", "code"}, document
        # Django's generic refusal would mean the request never reached the front door.
        assert error["message"] != "bad request", document
