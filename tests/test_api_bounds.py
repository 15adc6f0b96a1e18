"""Every whole number a client sends the control-plane API, in a query string or a body, has a
maximum (``platform_site.api.MAX_INT``): past it the answer is a 400 naming the field, never the
database's overflow as a 500 (an ``offset`` of 2**63 on the prediction list was one)."""

from __future__ import annotations

from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator

from platform_site.api import MAX_INT
from tests.factories import make_model, make_version
from tests.test_rollouts_api import key_client


def _unbounded(schema: dict[str, Any]) -> list[str]:
    components = schema["components"]["schemas"]
    found: list[str] = []

    def walk(node: dict[str, Any], where: str, seen: frozenset[str]) -> None:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            if name not in seen:
                walk(components[name], f"{where} {name}", seen | {name})
            return
        if node.get("type") == "integer" and not node.get("readOnly") and "maximum" not in node:
            found.append(where)
        for field, inner in node.get("properties", {}).items():
            walk(inner, f"{where}.{field}", seen)
        if "items" in node:
            walk(node["items"], f"{where}[]", seen)
        for inner in node.get("allOf", []) + node.get("oneOf", []) + node.get("anyOf", []):
            walk(inner, where, seen)

    for url, operations in schema["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []):
                kind = parameter.get("schema", {})
                if parameter["in"] == "query" and kind.get("type") == "integer":
                    if "maximum" not in kind:
                        found.append(f"{method.upper()} {url} ?{parameter['name']}")
            for body in operation.get("requestBody", {}).get("content", {}).values():
                walk(body["schema"], f"{method.upper()} {url} body", frozenset())
    return sorted(set(found))


def test_every_integer_a_client_sends_has_a_maximum():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    assert _unbounded(schema) == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query", ["offset", "version"], ids=["offset past the maximum", "version past the maximum"]
)
def test_a_number_past_the_maximum_is_a_400_naming_it(world, onnx_bytes, query):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    api = key_client(world.key_a)
    for value in (MAX_INT + 1, 2**63, 2**64):
        answer = api.get(f"/api/v1/models/clf/predictions?{query}={value}")
        assert answer.status_code == 400, (value, answer.content[:200])
        assert query in answer.json()["fields"]
    assert api.get(f"/api/v1/models/clf/predictions?{query}={MAX_INT}").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/rollouts/{n}",
        "/api/v1/models/clf/versions/{n}",
        "/api/v1/alerts/{n}",
        "/jobs/{n}/",
        "/keys/{n}/revoke/",
    ],
)
def test_an_id_in_the_path_past_the_maximum_is_a_404(world, onnx_bytes, path, client):
    """A path's whole number is an id: past ``MAX_INT`` no row can have it (404), never the
    database's overflow as a 500."""
    make_version(make_model(world.a, "clf"), onnx_bytes)
    api = key_client(world.key_a)
    client.force_login(world.engineer_a)
    for value in (MAX_INT + 1, 2**63, 2**64, 10**40):
        url = path.format(n=value)
        http = api if url.startswith("/api/") else client
        answer = http.post(url) if url.endswith("revoke/") else http.get(url)
        assert answer.status_code == 404, (url, answer.status_code, answer.content[:200])
