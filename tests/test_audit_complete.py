"""A complete, durable audit log: every state change (uploads, serving settings, personal
fields, model settings, quotas, role grants, tenants, any admin save) writes an event; events
outlive their tenant; neither the ORM nor raw SQL can change or delete one; the export streams
CSV and JSON Lines of the caller's tenant only."""

from __future__ import annotations

import csv
import io
import json

import orjson
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection, transaction
from rest_framework.test import APIClient

from registry.models import ModelVersion
from tenants.audit import SYSTEM, audit
from tenants.models import AuditEvent, Membership, Quota, Tenant
from tests.factories import ADMIN_VERSION_FIELDS, make_member, make_model, make_tenant, make_version
from tests.onnx_models import small_onnx
from tests.test_rollouts_api import key_client

pytestmark = pytest.mark.backends


@pytest.fixture
def admin_client(client, django_user_model):
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw-root-123")
    client.force_login(root)
    return client


def last(action: str) -> AuditEvent:
    return AuditEvent.objects.filter(action=action).first()  # newest first


# every state change ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_version_upload_is_audited(world):
    make_model(world.a, "clf")
    data = {"artifact": SimpleUploadedFile("m.onnx", small_onnx())}
    response = key_client(world.key_a).post("/api/v1/models/clf/versions", data)
    assert response.status_code == 201
    event = last("version.create")
    version = ModelVersion.objects.get()
    assert event.tenant_id == world.a.pk and event.target == str(version)
    assert event.after["sha256"] == version.sha256 and event.actor_label.startswith("api-key:")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change",
    [{"max_batch_size": 4, "description": "smaller batches"}, {"personal_fields": {"x": "hash"}}],
    ids=["serving-settings", "personal-fields"],
)
def test_serving_settings_and_personal_field_rules_are_audited(world, onnx_bytes, change):
    make_version(make_model(world.a, "clf"), onnx_bytes)
    response = key_client(world.key_a).patch("/api/v1/models/clf/versions/1", change, format="json")
    assert response.status_code == 200, response.json()
    event = last("version.settings")
    assert event.after == change and set(event.before) == set(change)
    # Sending the same values again changes nothing and records nothing.
    key_client(world.key_a).patch("/api/v1/models/clf/versions/1", change, format="json")
    assert AuditEvent.objects.filter(action="version.settings").count() == 1


@pytest.mark.django_db
def test_model_creation_and_settings_are_audited(world):
    client = key_client(world.key_a)
    assert client.post("/api/v1/models", {"name": "m", "task": "regressor"}).status_code == 201
    assert last("model.create").target == "m"
    response = client.patch("/api/v1/models/m", {"log_sample_rate": 0.5}, format="json")
    assert response.status_code == 200
    assert last("model.update").after == {"log_sample_rate": 0.5}


@pytest.mark.django_db
def test_a_quota_change_in_the_admin_is_audited(admin_client):
    tenant = make_tenant("acme", rps=10, burst=20)
    url = f"/admin/tenants/tenant/{tenant.pk}/change/"
    form = {
        "name": "Acme",
        "slug": "acme",
        "alert_webhook_url": "",
        "quota-TOTAL_FORMS": "1",
        "quota-INITIAL_FORMS": "1",
        "quota-0-id": tenant.quota.pk,
        "quota-0-tenant": tenant.pk,
        "quota-0-requests_per_second": "50",
        "quota-0-burst": "20",
        "quota-0-max_concurrent_streams": "8",
        "quota-0-tokens_per_minute": "60000",
        "quota-0-max_replicas": "",
        "memberships-TOTAL_FORMS": "0",
        "memberships-INITIAL_FORMS": "0",
    }
    response = admin_client.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Quota.objects.get(tenant=tenant).requests_per_second == 50
    event = last("quota.update")
    assert (event.before, event.after) == (
        {"requests_per_second": 10.0},
        {"requests_per_second": 50.0},
    )
    assert (event.tenant_id, event.actor_label) == (tenant.pk, "root")


@pytest.mark.django_db
def test_a_role_grant_in_the_admin_is_audited(admin_client, django_user_model):
    tenant = make_tenant("acme")
    person = django_user_model.objects.create_user("bob", password="pw-bob-12345")
    response = admin_client.post(
        "/admin/tenants/membership/add/",
        {"tenant": tenant.pk, "user": person.pk, "role": "approver"},
    )
    assert response.status_code == 302
    event = last("membership.create")
    assert event.tenant_id == tenant.pk and event.after["role"] == "approver"
    membership = Membership.objects.get(user=person)
    admin_client.post(
        f"/admin/tenants/membership/{membership.pk}/change/",
        {"tenant": tenant.pk, "user": person.pk, "role": "viewer"},
    )
    assert (last("membership.update").before, last("membership.update").after) == (
        {"role": "approver"},
        {"role": "viewer"},
    )
    admin_client.post(f"/admin/tenants/membership/{membership.pk}/delete/", {"post": "yes"})
    assert not Membership.objects.filter(user=person).exists()
    assert last("membership.delete").before["role"] == "viewer"


@pytest.mark.django_db
def test_any_admin_save_is_audited(admin_client):
    tenant = make_tenant("acme")
    model = make_model(tenant, "clf")
    response = admin_client.post(
        f"/admin/registry/model/{model.pk}/change/",
        {
            "tenant": tenant.pk,
            "name": "clf",
            "task": "classifier",
            "description": "edited in the admin",
            "log_sample_rate": "1.0",
            "log_retention_days": "30",
            "drift_threshold": "0.2",
            "drift_window_minutes": "60",
            "slo_availability": "0.999",
            "slo_latency_ms": "200",
            "slo_latency_target": "0.99",
            "primary_timeout_ms": "",
            "fallback_timeout_ms": "",
            "default_answer": "null",
        },
    )
    assert response.status_code == 302, response.content.decode()[:3000]
    event = last("model.update")
    assert event.after["description"] == "edited in the admin" and event.reason == "Django admin"


@pytest.mark.django_db
def test_a_version_upload_and_setting_change_in_the_admin_are_audited(admin_client, onnx_bytes):
    model = make_model(make_tenant("acme"))
    fields = {"model": model.pk, **ADMIN_VERSION_FIELDS}
    upload = {**fields, "upload": SimpleUploadedFile("m.onnx", onnx_bytes)}
    assert admin_client.post("/admin/registry/modelversion/add/", upload).status_code == 302
    assert last("version.create").actor_label == "root"
    version = ModelVersion.objects.get()
    changed = {**fields, "personal_fields": '{"x": "redact"}'}
    url = f"/admin/registry/modelversion/{version.pk}/change/"
    assert admin_client.post(url, changed).status_code == 302
    event = last("version.settings")
    assert (event.before, event.after) == (
        {"personal_fields": {}},
        {"personal_fields": {"x": "redact"}},
    )


# durable ---------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_deleting_a_tenant_keeps_its_audit_rows_and_is_itself_audited(admin_client):
    tenant = make_tenant("doomed")
    for n in range(3):
        audit(tenant.pk, SYSTEM, "test.event", f"thing {n}")
    before = AuditEvent.objects.filter(tenant_id=tenant.pk).count()
    response = admin_client.post(f"/admin/tenants/tenant/{tenant.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not Tenant.objects.filter(slug="doomed").exists()
    kept = AuditEvent.objects.filter(tenant_id=tenant.pk)
    assert kept.count() == before + 1  # and the deletion itself
    assert {e.tenant_slug for e in kept} == {"doomed"}
    assert kept.first().action == "tenant.delete" and kept.first().actor_label == "root"
    # The admin still lists them, and opens one, with no tenant row to follow.
    listed = admin_client.get("/admin/tenants/auditevent/?tenant_slug=doomed")
    assert listed.status_code == 200 and "thing 2" in listed.content.decode()
    opened = admin_client.get(f"/admin/tenants/auditevent/{kept.first().pk}/change/")
    assert opened.status_code == 200


@pytest.mark.django_db
def test_a_tenant_deleted_outside_the_admin_is_audited_too():
    tenant = make_tenant("gone")
    tenant_id = tenant.pk
    tenant.delete()
    event = AuditEvent.objects.get(tenant_id=tenant_id)
    assert (event.action, event.actor_label, event.tenant_slug) == (
        "tenant.delete",
        "system",
        "gone",
    )


@pytest.mark.django_db
def test_deleting_a_user_keeps_the_events_they_made(world, django_user_model):
    person = make_member(world.a, "gone", "engineer")
    person_id = person.pk
    audit(world.a.pk, type(SYSTEM)(person_id, "gone"), "test.event", "x")
    person.delete()
    event = AuditEvent.objects.get(action="test.event")
    assert (event.actor_id, event.actor_label) == (person_id, "gone")


@pytest.mark.django_db
def test_querysets_cannot_update_or_delete_audit_events(world):
    audit(world.a.pk, SYSTEM, "test.event", "x")
    with pytest.raises(Exception, match="append-only"):
        AuditEvent.objects.update(reason="rewritten")
    with pytest.raises(Exception, match="append-only"):
        AuditEvent.objects.filter(action="test.event").delete()
    assert AuditEvent.objects.get(action="test.event").reason == ""


@pytest.mark.django_db
@pytest.mark.parametrize(
    "sql",
    ["UPDATE rollouts_auditevent SET reason = 'rewritten'", "DELETE FROM rollouts_auditevent"],
    ids=["update", "delete"],
)
def test_the_database_refuses_raw_updates_and_deletes(world, sql):
    audit(world.a.pk, SYSTEM, "test.event", "x")
    with pytest.raises(Exception, match="append-only"), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(sql)
    assert AuditEvent.objects.get(action="test.event").reason == ""


# export ----------------------------------------------------------------------------------------


@pytest.fixture
def events(world):
    audit(world.a.pk, SYSTEM, "plan.weight", "clf@production", {"weight": 5}, {"weight": 50})
    audit(world.a.pk, SYSTEM, "alias.move", '=HYPERLINK("x")', reason='bad, "quoted"\nline')
    audit(world.b.pk, SYSTEM, "plan.weight", "theirs@production", {"weight": 1}, {"weight": 2})


def export(client: APIClient, query: str):
    response = client.get(f"/api/v1/audit/export?{query}")
    assert response.status_code == 200, response.content
    assert response.streaming
    return response, b"".join(response.streaming_content).decode()


@pytest.mark.django_db
def test_export_as_csv_is_the_tenants_log(world, events):
    response, text = export(key_client(world.key_a), "format=csv")
    assert response["Content-Type"].startswith("text/csv")
    assert 'filename="audit-alpha.csv"' in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(text)))
    # Newest first, the tenant's own only (its keys' creation came before these).
    assert [r["action"] for r in rows][:2] == ["alias.move", "plan.weight"]
    assert len(rows) == AuditEvent.objects.filter(tenant=world.a).count()
    assert "theirs@production" not in text
    assert rows[1]["target"] == "clf@production" and json.loads(rows[1]["after"]) == {"weight": 50}
    assert rows[0]["target"] == '\'=HYPERLINK("x")'  # a formula is never a live formula
    assert rows[0]["reason"] == 'bad, "quoted"\nline' and rows[0]["tenant_slug"] == "alpha"


@pytest.mark.django_db
def test_export_as_json_lines_filters_as_the_list_does(world, events):
    response, text = export(key_client(world.key_a), "format=jsonl&action=plan.weight")
    assert response["Content-Type"] == "application/x-ndjson"
    lines = [orjson.loads(line) for line in text.splitlines()]
    assert len(lines) == 1 and lines[0]["after"] == {"weight": 50}
    assert lines[0]["tenant_slug"] == "alpha" and lines[0]["target"] == "clf@production"
    _, theirs = export(key_client(world.key_b), "format=jsonl")
    assert "clf@production" not in theirs and "theirs@production" in theirs


@pytest.mark.django_db
def test_export_refuses_an_unknown_format_and_needs_a_member(world, events):
    response = key_client(world.key_a).get("/api/v1/audit/export?format=xml")
    assert response.status_code == 400 and "format" in response.json()["error"]
    outsider = APIClient()
    outsider.force_login(world.outsider)
    assert outsider.get("/api/v1/audit/export?format=csv").status_code == 403


@pytest.mark.django_db
def test_the_audit_page_links_to_the_export_of_its_tenant(world, events, client):
    client.force_login(world.engineer_a)
    page = client.get("/audit/").content.decode()
    assert "/api/v1/audit/export?format=csv&amp;tenant=alpha" in page
    assert "/api/v1/audit/export?format=jsonl&amp;tenant=alpha" in page
    response = client.get("/api/v1/audit/export?format=jsonl&tenant=alpha")
    lines = b"".join(response.streaming_content).decode().splitlines()
    assert len(lines) == AuditEvent.objects.filter(tenant=world.a).count()
    assert all(orjson.loads(line)["tenant_slug"] == "alpha" for line in lines)


@pytest.mark.django_db
def test_nodes_and_their_tokens_are_audited_shared_ones_platform_wide(world):
    from fleet.nodes import create_node, rotate_node_token

    shared, _ = create_node("shared-gpu")
    theirs, _ = create_node("beta-box", tenant=world.b)
    rotate_node_token(theirs)
    created = AuditEvent.objects.filter(action="node.create")
    assert {(e.target, e.tenant_id) for e in created} == {
        ("node shared-gpu", None),
        ("node beta-box", world.b.pk),
    }
    rotated = last("node.rotate_token")
    assert rotated.before["token_prefix"] != rotated.after["token_prefix"]
    assert rotated.after["token_prefix"] == theirs.token_prefix and rotated.tenant_slug == "beta"


@pytest.mark.django_db
def test_create_tenant_audits_the_tenant_and_its_owners_grant():
    from io import StringIO

    from django.core.management import call_command

    call_command("create_tenant", "acme", "--owner", "ann", stdout=StringIO())
    tenant = Tenant.objects.get(slug="acme")
    actions = set(AuditEvent.objects.filter(tenant=tenant).values_list("action", flat=True))
    assert actions == {"tenant.create", "membership.create", "key.create"}


@pytest.mark.django_db(transaction=True)
def test_export_streams_in_batches_under_asgi(world, monkeypatch):
    from asgiref.sync import async_to_sync
    from channels.testing import HttpCommunicator
    from django.db import connections

    from platform_site.asgi import application

    # The request's database thread closes its connection when the response ends, so none
    # outlives the test database (as in tests/test_grpc_server.py).
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)

    for n in range(1200):  # more than two batches of 500 lines
        audit(world.a.pk, SYSTEM, "test.event", f"thing {n}")

    async def get():
        headers = [(b"host", b"testserver"), (b"authorization", f"Bearer {world.key_a}".encode())]
        path = "/api/v1/audit/export?format=jsonl&action=test.event"
        communicator = HttpCommunicator(application, "GET", path, headers=headers)
        await communicator.send_input({"type": "http.request", "body": b""})
        start = await communicator.receive_output(timeout=10)
        parts = []
        while True:
            message = await communicator.receive_output(timeout=10)
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                await communicator.wait()  # the app closes the response and its connection
                return start, parts

    start, parts = async_to_sync(get)()
    assert start["status"] == 200, parts
    lines = b"".join(parts).splitlines()
    assert len(lines) == 1200 and orjson.loads(lines[0])["target"] == "thing 1199"
    assert len([p for p in parts if p]) >= 3  # sent batch by batch, not as one body
