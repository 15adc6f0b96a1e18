"""Artifact download for agents: node token required, only versions assigned to the node."""

import hashlib

from fleet.assignments import assignment_for
from fleet.nodes import create_node
from tests.factories import make_model, make_session, make_tenant, make_version


def get(client, version_id, token):
    return client.get(f"/api/v1/agent/artifacts/{version_id}", HTTP_AUTHORIZATION=f"Bearer {token}")


def test_node_downloads_an_assigned_artifact_with_its_hash(client, db, onnx_bytes):
    version = make_version(make_model(make_tenant("acme")), onnx_bytes)
    node, token = create_node("n1")
    response = get(client, version.pk, token)
    assert response.status_code == 200
    body = b"".join(response.streaming_content)
    assert hashlib.sha256(body).hexdigest() == version.sha256 == response["X-Artifact-Sha256"]
    assert [s.version_id for s in assignment_for(node, make_session(node).pk)] == [version.pk]


def test_bad_or_missing_node_token_gets_401(client, db, onnx_bytes):
    version = make_version(make_model(make_tenant("acme")), onnx_bytes)
    assert get(client, version.pk, "syn_abc_def").status_code == 401
    assert client.get(f"/api/v1/agent/artifacts/{version.pk}").status_code == 401


def test_api_key_is_not_a_node_token(client, db, onnx_bytes):
    from tests.factories import make_key

    tenant = make_tenant("acme")
    version = make_version(make_model(tenant), onnx_bytes)
    assert get(client, version.pk, make_key(tenant)[1]).status_code == 401


def test_node_of_another_tenant_gets_404(client, db, onnx_bytes):
    version = make_version(make_model(make_tenant("acme")), onnx_bytes)
    node, token = create_node("beta-node", tenant=make_tenant("beta"))
    assert get(client, version.pk, token).status_code == 404
    assert assignment_for(node, make_session(node).pk) == []


def test_version_without_an_alias_is_not_handed_out(client, db, onnx_bytes):
    version = make_version(make_model(make_tenant("acme")), onnx_bytes, alias=None)
    _, token = create_node("n1")
    assert get(client, version.pk, token).status_code == 404
    assert get(client, 999999, token).status_code == 404


def test_disabled_node_is_refused(client, db, onnx_bytes):
    version = make_version(make_model(make_tenant("acme")), onnx_bytes)
    node, token = create_node("n1")
    node.enabled = False
    node.save()
    assert get(client, version.pk, token).status_code == 401
