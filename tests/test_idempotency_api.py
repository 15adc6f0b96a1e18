"""``Idempotency-Key`` on the control plane's state-changing calls (tenants.middleware): a retry
gets the first answer and acts once (one version, one approval request, one audit event); the
key used for another request is a 422, one still running a 409, a malformed one a 400; keys are
per caller, so another tenant never reads a stored answer."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test.client import encode_multipart
from django.utils import timezone
from rest_framework.test import APIClient

from registry.models import ModelVersion
from rollouts.models import ApprovalRequest
from tenants import idempotency
from tenants.models import AuditEvent, IdempotencyRecord, Role
from tests.factories import make_member, make_model, make_version
from tests.onnx_models import small_onnx

pytestmark = pytest.mark.backends

REPLAYED = "Idempotent-Replayed"
STORED = "Idempotency-Stored"


def key_client(key: str) -> APIClient:
    client = APIClient()
    client.default_format = "json"
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def as_user(user, tenant_slug: str = "alpha") -> APIClient:
    client = APIClient()
    client.default_format = "json"
    client.force_login(user)
    client.credentials(HTTP_X_TENANT=tenant_slug)
    return client


@pytest.fixture
def served(world, onnx_bytes):
    """Tenant A's ``clf`` with v1 in production and v2 uploaded."""
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes)
    make_version(model, small_onnx(seed=3), alias=None)
    world.model = model
    return world


def move(client, alias: str, version: int, key: str | None, comment: str = ""):
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    body = {"version": version, "comment": comment}
    return client.put(f"/api/v1/models/clf/aliases/{alias}", body, **headers)


def test_a_retried_alias_move_acts_once_and_gets_the_first_answer(served):
    client = key_client(served.key_a)
    first = move(client, "staging", 2, "move-1")
    second = move(client, "staging", 2, "move-1")
    assert first.status_code == second.status_code == 200
    assert second.content == first.content
    assert second[REPLAYED] == "true" and not first.has_header(REPLAYED)
    assert second["Content-Type"] == first["Content-Type"]
    assert AuditEvent.objects.filter(action="alias.move", target__endswith="@staging").count() == 1


def test_an_answer_too_large_to_keep_still_acts_once_and_says_so(served, settings):
    """The call acted, so its retry must not act again: it gets the status without the body
    (a prediction's key is freed instead, tests/test_idempotency_bounds.py)."""
    settings.SWITCHYARD_IDEMPOTENCY_MAX_ANSWER_BYTES = 10
    client = key_client(served.key_a)
    first = move(client, "staging", 2, "move-large")
    second = move(client, "staging", 2, "move-large")
    assert first.status_code == second.status_code == 200
    assert first[STORED] == second[STORED] == "false"
    assert first.json()["version"] == 2 and second.content == b""
    assert second[REPLAYED] == "true"
    assert AuditEvent.objects.filter(action="alias.move", target__endswith="@staging").count() == 1


def test_a_retried_promotion_request_opens_one_request(served):
    client = as_user(served.engineer_a)
    first = move(client, "production", 2, "promote-v2", "offline AUC +2")
    second = move(client, "production", 2, "promote-v2", "offline AUC +2")
    # Without the key the second call is a 409 ("an open promotion request"); with it, the
    # first 202 again.
    assert first.status_code == second.status_code == 202
    assert second.json() == first.json() and second[REPLAYED] == "true"
    assert ApprovalRequest.objects.count() == 1
    assert AuditEvent.objects.filter(action="approval.request").count() == 1


def test_a_retried_approval_approves_once(served):
    ann = make_member(served.a, "ann", Role.APPROVER)
    request_id = move(as_user(served.engineer_a), "production", 2, None).json()["id"]
    approver = as_user(ann)
    url = f"/api/v1/approvals/{request_id}/approve"
    first = approver.post(url, {"comment": "ship it"}, HTTP_IDEMPOTENCY_KEY="approve-1")
    second = approver.post(url, {"comment": "ship it"}, HTTP_IDEMPOTENCY_KEY="approve-1")
    assert first.status_code == second.status_code == 200, first.json()
    assert second.json() == first.json()
    assert AuditEvent.objects.filter(action="approval.approve").count() == 1
    # Without the key a second approval is refused: the request is decided.
    assert approver.post(url, {"comment": "ship it"}).status_code == 409


def test_a_retried_upload_creates_one_version_even_with_a_new_multipart_boundary(world, onnx_bytes):
    client = key_client(world.key_a)
    assert client.post("/api/v1/models", {"name": "clf", "task": "classifier"}).status_code == 201
    fields = {"artifact": SimpleUploadedFile("m.onnx", onnx_bytes), "alias": "production"}
    first = client.post(
        "/api/v1/models/clf/versions", fields, format="multipart", HTTP_IDEMPOTENCY_KEY="up-1"
    )
    assert first.status_code == 201, first.json()
    # A client that retries builds the body again, with a boundary of its own.
    boundary = "another-boundary-7"
    again = {"artifact": SimpleUploadedFile("m.onnx", onnx_bytes), "alias": "production"}
    second = client.generic(
        "POST",
        "/api/v1/models/clf/versions",
        encode_multipart(boundary, again),
        content_type=f"multipart/form-data; boundary={boundary}",
        HTTP_IDEMPOTENCY_KEY="up-1",
    )
    assert second.status_code == 201 and second.json() == first.json()
    assert ModelVersion.objects.filter(model__name="clf").count() == 1
    # Another artifact under the same key is another request.
    other = {"artifact": SimpleUploadedFile("m.onnx", small_onnx(seed=5))}
    third = client.post(
        "/api/v1/models/clf/versions", other, format="multipart", HTTP_IDEMPOTENCY_KEY="up-1"
    )
    assert third.status_code == 422 and "different request" in third.json()["error"]
    assert ModelVersion.objects.filter(model__name="clf").count() == 1


def test_the_key_reused_for_another_request_is_a_422_and_does_not_act(served):
    client = key_client(served.key_a)
    assert move(client, "staging", 2, "k-1").status_code == 200
    other = move(client, "staging", 1, "k-1")
    assert other.status_code == 422
    assert other.json()["error"].startswith("Idempotency-Key: 'k-1' was already used")
    other_path = client.put(
        "/api/v1/models/clf/aliases/canary", {"version": 2}, HTTP_IDEMPOTENCY_KEY="k-1"
    )
    assert other_path.status_code == 422
    assert served.model.aliases.get(name="staging").version.version == 2
    assert not served.model.aliases.filter(name="canary").exists()


def test_a_retry_while_the_first_call_runs_gets_409(served):
    client = key_client(served.key_a)
    # The first call's claim, as it stands while its view runs.
    assert move(client, "staging", 1, "warm-up").status_code == 200
    record = IdempotencyRecord.objects.get(key="warm-up")
    idempotency.begin(served.a.pk, record.caller, "busy", "a-fingerprint")
    response = move(client, "staging", 2, "busy")
    assert response.status_code == 409 and response["Retry-After"] == "1"
    assert "still being processed" in response.json()["error"]
    assert served.model.aliases.get(name="staging").version.version == 1


@pytest.mark.parametrize(
    "bad",
    ["x" * 256, "has space", "tab\there", "ümlaut", '""'],
    ids=["too-long", "space", "control", "non-ascii", "empty"],
)
def test_a_malformed_key_is_a_400_and_does_not_act(served, bad):
    client = key_client(served.key_a)
    response = move(client, "staging", 2, bad)
    assert response.status_code == 400
    assert response.json()["error"].startswith("Idempotency-Key: must be 1 to 255 printable")
    assert not AuditEvent.objects.filter(action="alias.move", target__endswith="@staging").exists()


def test_a_quoted_key_is_the_structured_field_form_of_the_same_key(served):
    client = key_client(served.key_a)
    assert move(client, "staging", 2, '"abc-1"').status_code == 200
    assert move(client, "staging", 2, "abc-1")[REPLAYED] == "true"


def test_keys_are_per_caller_so_another_tenant_never_reads_an_answer(served, onnx_bytes):
    make_version(make_model(served.b, "clf"), onnx_bytes)
    a = move(key_client(served.key_a), "staging", 2, "shared-key")
    b = move(key_client(served.key_b), "staging", 1, "shared-key")
    # Tenant B's call with the same key and another body acts on B's own model: no 422, no
    # replay of A's answer.
    assert a.status_code == b.status_code == 200
    assert not b.has_header(REPLAYED) and b.json()["version"] == 1
    assert (
        AuditEvent.objects.filter(
            action="alias.move", tenant=served.b, target__endswith="@staging"
        ).count()
        == 1
    )
    # A member of tenant A is another caller than A's key: the key is free for them too.
    mine = move(as_user(served.engineer_a), "staging", 2, "shared-key")
    assert mine.status_code == 200 and not mine.has_header(REPLAYED)


def test_a_refused_call_frees_its_key_for_the_retry(world, onnx_bytes):
    client = key_client(world.key_a)
    missing = move(client, "staging", 1, "early")
    assert missing.status_code == 404
    make_version(make_model(world.a, "clf"), onnx_bytes)
    retried = move(client, "staging", 1, "early")
    assert retried.status_code == 200 and not retried.has_header(REPLAYED)
    assert move(client, "staging", 1, "early")[REPLAYED] == "true"


def test_answers_past_retention_are_purged_and_the_key_acts_again(served):
    client = key_client(served.key_a)
    assert move(client, "staging", 2, "old").status_code == 200
    past = timezone.now() - timedelta(seconds=settings.SWITCHYARD_IDEMPOTENCY_RETENTION_S + 1)
    IdempotencyRecord.objects.update(created_at=past)
    again = move(client, "staging", 2, "old")  # expired, not yet purged: acts again
    assert again.status_code == 200 and not again.has_header(REPLAYED)
    assert AuditEvent.objects.filter(action="alias.move", target__endswith="@staging").count() == 2
    IdempotencyRecord.objects.update(created_at=past)
    assert idempotency.purge_expired() == 1
    assert not IdempotencyRecord.objects.exists()
    tasks = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert "tenants.tasks.purge_idempotency_records" in tasks


def test_calls_without_the_key_and_reads_are_untouched(served):
    client = key_client(served.key_a)
    assert move(client, "staging", 2, None).status_code == 200
    read = client.get("/api/v1/models/clf/aliases/staging", HTTP_IDEMPOTENCY_KEY="a b")
    assert read.status_code == 200  # a GET never acts: its key is ignored, even a bad one
    assert not IdempotencyRecord.objects.exists()


def test_the_schema_documents_the_key_and_its_statuses_on_every_change(world):
    client = key_client(world.key_a)
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    changes = [
        (path, method, operation)
        for path, operations in schema["paths"].items()
        if path.startswith("/api/v1/")
        for method, operation in operations.items()
        if method in ("post", "put", "patch", "delete")
    ]
    assert len(changes) > 10
    for path, method, operation in changes:
        names = [p["name"] for p in operation.get("parameters", []) if p["in"] == "header"]
        assert "Idempotency-Key" in names, (method, path)
        assert {"400", "409", "422"} <= set(operation["responses"]), (method, path)
    alias = schema["paths"]["/api/v1/models/{name}/aliases/{alias}"]
    assert "Idempotency-Key" not in [p["name"] for p in alias["get"].get("parameters", [])]


def test_a_broken_multipart_body_with_a_key_is_a_400(world):
    client = key_client(world.key_a)
    assert client.post("/api/v1/models", {"name": "clf", "task": "classifier"}).status_code == 201
    response = client.generic(
        "POST",
        "/api/v1/models/clf/versions",
        b'--b\r\nContent-Disposition: form-data; name="artifact"; filename="m"\r\n\r\nx',
        content_type="multipart/form-data; boundary=",  # no boundary: cannot be parsed
        HTTP_IDEMPOTENCY_KEY="broken-1",
    )
    assert response.status_code == 400 and "cannot be read as a form" in response.json()["error"]
    assert not IdempotencyRecord.objects.exists()
