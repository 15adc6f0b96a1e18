"""The admin: a new API key or node token is shown once; versions upload through the checks."""

import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fleet.models import Node
from fleet.nodes import authenticate_node
from registry.models import ModelVersion
from tenants.keys import identify_key
from tenants.models import ApiKey, AuditEvent
from tests.factories import ADMIN_VERSION_FIELDS, make_model, make_tenant


@pytest.fixture
def admin_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw-root-123")
    client.force_login(user)
    return client


def shown_secret(response, prefix: str) -> str:
    text = response.content.decode()
    found = re.search(rf"({prefix}_[0-9a-f]{{8}}_[A-Za-z0-9-]+)", text)
    assert found, "the new secret is shown on the page after creation"
    return found.group(1)


def test_creating_a_key_in_the_admin_shows_it_once_and_it_works(admin_client, db):
    tenant = make_tenant("acme")
    response = admin_client.post(
        "/admin/tenants/apikey/add/", {"tenant": tenant.pk, "name": "ci"}, follow=True
    )
    raw = shown_secret(response, "sy")
    assert identify_key(raw).tenant_id == tenant.pk
    key = ApiKey.objects.get()
    assert raw not in admin_client.get(f"/admin/tenants/apikey/{key.pk}/change/").content.decode()


def test_revoking_keys_from_the_admin(admin_client, db):
    tenant = make_tenant("acme")
    admin_client.post("/admin/tenants/apikey/add/", {"tenant": tenant.pk, "name": "ci"})
    key = ApiKey.objects.get()
    admin_client.post("/admin/tenants/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.revoked_at is not None
    events = AuditEvent.objects.filter(tenant=tenant)
    assert [(e.action, e.actor_label) for e in events] == [
        ("key.revoke", "root"),
        ("key.create", "root"),
    ]


def test_audit_and_approvals_are_read_only_in_the_admin(admin_client, db):
    tenant = make_tenant("acme")
    admin_client.post("/admin/tenants/apikey/add/", {"tenant": tenant.pk, "name": "ci"})
    event = AuditEvent.objects.get()
    assert admin_client.get("/admin/tenants/auditevent/?action=key.create").status_code == 200
    page = admin_client.get(f"/admin/tenants/auditevent/{event.pk}/change/").content.decode()
    assert 'name="_save"' not in page
    assert admin_client.get("/admin/tenants/auditevent/add/").status_code == 403
    assert admin_client.get("/admin/rollouts/approvalrequest/").status_code == 200
    assert admin_client.get("/admin/rollouts/approvalrequest/add/").status_code == 403


def test_creating_a_node_in_the_admin_shows_its_token_once(admin_client, db):
    response = admin_client.post(
        "/admin/fleet/node/add/", {"name": "gpu-1", "enabled": "on"}, follow=True
    )
    token = shown_secret(response, "syn")
    assert authenticate_node(token) == Node.objects.get(name="gpu-1")


def test_uploading_a_version_in_the_admin_checks_the_artifact(admin_client, db, onnx_bytes):
    model = make_model(make_tenant("acme"))
    fields = {"model": model.pk, **ADMIN_VERSION_FIELDS}
    bad = admin_client.post(
        "/admin/registry/modelversion/add/",
        {**fields, "upload": SimpleUploadedFile("m.onnx", b"junk")},
    )
    assert "not a valid ONNX model" in bad.content.decode()
    # A tokenizer only fits a graph that takes token ids.
    tokenizer = SimpleUploadedFile("tokenizer.json", b'{"model": {}}')
    refused = admin_client.post(
        "/admin/registry/modelversion/add/",
        {**fields, "upload": SimpleUploadedFile("m.onnx", onnx_bytes), "tokenizer_file": tokenizer},
    )
    assert "tokenizer: not a valid tokenizer.json" in refused.content.decode()
    good = admin_client.post(
        "/admin/registry/modelversion/add/",
        {**fields, "upload": SimpleUploadedFile("m.onnx", onnx_bytes)},
    )
    assert good.status_code == 302
    version = ModelVersion.objects.get()
    assert version.inputs[0]["name"] == "x" and version.max_batch_size == 8
    # A change goes through the API's checks: personal fields must name the version's inputs.
    url = f"/admin/registry/modelversion/{version.pk}/change/"
    changed = {**fields, "personal_fields": '{"nope": "redact"}'}
    refused = admin_client.post(url, changed)
    assert "is not an input or feature of this version" in refused.content.decode()
    assert admin_client.post(url, {**fields, "personal_fields": '{"x": "hash"}'}).status_code == 302
    version.refresh_from_db()
    assert version.personal_fields == {"x": "hash"}
