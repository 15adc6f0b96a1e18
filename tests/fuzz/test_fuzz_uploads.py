"""Hypothesis-generated artifacts and upload fields for ``POST /api/v1/models/{name}/versions``
(the API's upload of a new version): bytes that are no model, truncated and corrupted ONNX
files, safetensors-like headers, and hostile signature fields are a 400 naming the field, never
a server error. (Uploads through the admin run the same ``registry.services.create_version``.)"""

from __future__ import annotations

import json
import struct

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from tests.factories import make_key, make_model, make_tenant
from tests.fuzz.strategies import HOSTILE_LITERALS, fuzz, json_values
from tests.onnx_models import small_onnx

ONNX = small_onnx()


@st.composite
def artifacts(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "truncated", "corrupted", "safetensors"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "truncated":
        return ONNX[: draw(st.integers(0, len(ONNX) - 1))]
    if kind == "corrupted":
        at = draw(st.integers(0, len(ONNX) - 1))
        return ONNX[:at] + bytes([ONNX[at] ^ 0xFF]) + ONNX[at + 1 :]
    header = draw(st.sampled_from(HOSTILE_LITERALS) | json_values.map(json.dumps)).encode()
    size = draw(st.sampled_from([len(header), 0, 2**63, len(header) + 5]))
    return struct.pack("<Q", size) + header + draw(st.binary(max_size=40))


fields = st.fixed_dictionaries(
    {},
    optional={
        "format": st.sampled_from(["onnx", "textgen", "torch", "pickle", ""]),
        "inputs": json_values.map(json.dumps) | st.sampled_from(HOSTILE_LITERALS),
        "outputs": json_values.map(json.dumps),
        "feature_names": json_values.map(json.dumps),
        "offline_metrics": json_values.map(json.dumps) | st.sampled_from(HOSTILE_LITERALS),
        "parent": st.sampled_from(["1", "0", "-1", "²", "99999999999999999999"]),
        "reference": json_values.map(json.dumps) | st.sampled_from(HOSTILE_LITERALS),
        "personal_fields": json_values.map(json.dumps) | st.sampled_from(HOSTILE_LITERALS),
    },
)


@pytest.fixture
def key(db: None) -> str:
    tenant = make_tenant("alpha")
    make_model(tenant, "clf")
    return make_key(tenant)[1]


@fuzz(60)
@given(artifact=artifacts(), extra=fields)
def test_uploads_never_get_a_server_error(key: str, artifact: bytes, extra: dict[str, str]) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    data = {"artifact": SimpleUploadedFile("m.onnx", artifact), **extra}
    response = client.post("/api/v1/models/clf/versions", data, format="multipart")
    assert response.status_code < 500, response.content[:300]
    if response.status_code >= 400:
        assert response.json()["error"], response.content[:300]
