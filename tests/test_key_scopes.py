"""Scoped, expiring API keys that act as their creator: scopes enforced on every front door and
on the control-plane API, expiry on the hot path and the API, rotation with an overlap, the
keys API (tenant-scoped; no one gives a key more power than they have) and the keys page."""

from __future__ import annotations

import json
from datetime import timedelta

import grpc
import pytest
from asgiref.sync import async_to_sync
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from gateway.admission import authenticate
from gateway.errors import ApiError
from gateway.state import GatewayState
from rollouts.models import RolloutPlan
from tenants.authentication import KeyPrincipal, actor_of, caller_of
from tenants.keys import identify_key, rotate_api_key
from tenants.models import ApiKey, AuditEvent, Membership
from tests.factories import make_key, make_member, make_model, make_version
from tests.onnx_models import small_onnx
from tests.test_front_door_limits import OIP_BODY, PREDICT_BODY, openai_call, send, state  # noqa: F401
from tests.test_grpc_server import X, bearer, call, infer_request, site  # noqa: F401
from tests.test_rollouts_api import key_client

GUARDRAILS = {"max_error_rate_increase": 0.02, "max_p99_ratio": 1.5, "min_samples": 200}
FEATURES = ["amount", "hour", "risk", "age"]


@pytest.fixture
def two_versions(world, onnx_bytes):
    model = make_model(world.a, "clf")
    make_version(model, onnx_bytes, feature_names=FEATURES)
    make_version(model, small_onnx(seed=3), alias=None)
    return model


def upload(client: APIClient, artifact: bytes):
    data = {"artifact": SimpleUploadedFile("m.onnx", artifact)}
    return client.post("/api/v1/models/clf/versions", data, format="multipart")


def start(client: APIClient):
    body = {"mode": "canary", "candidate": 2, "weight": 5, "guardrails": GUARDRAILS}
    return client.post("/api/v1/models/clf/rollouts", body, format="json")


# deploy: the control plane's writes ------------------------------------------------------------


@pytest.mark.django_db
def test_an_inference_only_key_cannot_upload_start_or_kill(world, two_versions):
    _, predict_only = make_key(world.a, "app", scopes=("predict",))
    client = key_client(predict_only)
    refused = upload(client, small_onnx(seed=5))
    assert refused.status_code == 403 and "'deploy' scope" in refused.json()["error"]
    refused = start(client)
    assert refused.status_code == 403 and "'deploy' scope" in refused.json()["error"]
    plan_id = start(key_client(world.key_a)).json()["id"]  # an engineer's deploy key may
    killed = client.post(f"/api/v1/rollouts/{plan_id}/kill", {}, format="json")
    assert killed.status_code == 403 and "'deploy' scope" in killed.json()["error"]
    assert RolloutPlan.objects.get(pk=plan_id).is_active
    assert two_versions.versions.count() == 2
    # Reads need any scope.
    assert client.get("/api/v1/models/clf/versions").status_code == 200


@pytest.mark.django_db
def test_a_key_whose_creator_left_the_tenant_cannot_write(world, two_versions):
    engineer = make_member(world.a, "leaver", "engineer")
    _, raw = make_key(world.a, "theirs", creator=engineer)
    assert upload(key_client(raw), small_onnx(seed=5)).status_code == 201
    Membership.objects.filter(user=engineer).delete()
    refused = upload(key_client(raw), small_onnx(seed=6))
    assert refused.status_code == 403
    assert "this key has no owner in this tenant" in refused.json()["error"]
    assert key_client(raw).get("/api/v1/models").status_code == 200  # reads still work


@pytest.mark.django_db
def test_a_key_acts_as_its_creators_current_role(world, two_versions):
    engineer = make_member(world.a, "demoted", "engineer")
    _, raw = make_key(world.a, "theirs", creator=engineer)
    Membership.objects.filter(user=engineer).update(role="viewer")
    assert upload(key_client(raw), small_onnx(seed=5)).status_code == 403


@pytest.mark.django_db
def test_a_keys_actor_is_its_creator(world, rf):
    approver = make_member(world.a, "alice", "approver")
    key, raw = make_key(world.a, "alice's", creator=approver)
    request = rf.get("/api/v1/models")
    request.user = KeyPrincipal(identify_key(raw))
    request.query_params = {}
    request.caller = caller_of(request)
    actor = actor_of(request)
    assert (actor.user_id, actor.via_key, actor.role) == (approver.pk, key.pk, "approver")
    assert actor.label == f"api-key:{key.pk} (alice)"
    # An upload through the key is recorded as the creator's.
    make_model(world.a, "clf")
    created = upload(key_client(raw), small_onnx())
    assert created.status_code == 201
    event = AuditEvent.objects.get(action="version.create")
    assert (event.actor_id, event.actor_label) == (approver.pk, f"api-key:{key.pk} (alice)")


# predict: every front door ---------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path, body",
    [("/v2/models/clf/infer", OIP_BODY), ("/api/v1/models/clf/predict", PREDICT_BODY)],
    ids=["oip-rest", "prediction-api"],
)
def test_a_key_without_predict_cannot_infer(world, state, two_versions, path, body):  # noqa: F811
    _, deploy_only = make_key(world.a, "ci", scopes=("deploy",))
    status, _, error = async_to_sync(send)(path, body, deploy_only)
    assert status == 403 and "'predict' scope" in error["error"]


@pytest.mark.django_db(transaction=True)
def test_a_key_without_predict_cannot_use_openai(world, state):  # noqa: F811
    _, deploy_only = make_key(world.a, "ci", scopes=("deploy",))
    body = {"model": "gen", "prompt": "hi", "max_tokens": 2}
    response = async_to_sync(openai_call(deploy_only, body))()
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "permission_error" and "'predict' scope" in error["message"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.db_threads
def test_a_key_without_predict_cannot_use_grpc(site, world):  # noqa: F811
    _, deploy_only = make_key(world.a, "ci", scopes=("deploy",))
    refused = call(site, "ModelInfer", infer_request(X), bearer(deploy_only))
    assert refused.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "'predict' scope" in refused.details()


# expiry and rotation ---------------------------------------------------------------------------


def check(raw: str, gateway: GatewayState):
    async def run():
        try:
            return await authenticate(gateway, f"Bearer {raw}")
        except ApiError as exc:
            return exc

    return async_to_sync(run)()


@pytest.mark.django_db(transaction=True)
def test_an_expired_key_is_refused_on_the_hot_path_and_the_api(world, two_versions, state):  # noqa: F811
    soon = timezone.now() + timedelta(seconds=30)
    key, raw = make_key(world.a, "short", expires_at=soon)
    assert check(raw, state).key_id == key.pk  # cached from here on
    assert key_client(raw).get("/api/v1/models").status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    state._keys.clear()  # as the refresh loop does after a change
    refused = check(raw, state)
    assert isinstance(refused, ApiError) and (refused.status, refused.message) == (
        401,
        "the API key has expired",
    )
    status, _, error = async_to_sync(send)("/v2/models/clf/infer", OIP_BODY, raw)
    assert status == 401 and "expired" in error["error"]
    response = key_client(raw).get("/api/v1/models")
    assert response.status_code == 401 and "expired" in response.json()["error"]


@pytest.mark.django_db(transaction=True)
def test_the_cached_identity_expires_without_a_query(world, state, django_assert_num_queries):  # noqa: F811
    key, raw = make_key(world.a, "short", expires_at=timezone.now() + timedelta(seconds=30))
    identity = check(raw, state)
    assert not identity.expired()
    assert identity.expired(now=identity.expires_ts + 0.001)  # the clock alone decides
    with django_assert_num_queries(0):
        assert check(raw, state).key_id == key.pk


@pytest.mark.django_db
def test_rotation_gives_a_working_key_and_the_old_one_works_until_the_overlap_ends(
    world, two_versions
):
    key, old_raw = make_key(world.a, "svc", scopes=("predict", "deploy"), priority=0)
    engineer = key.created_by
    response = key_client(world.key_a)  # deploy key: not admin, refused
    assert response.post(f"/api/v1/keys/{key.pk}/rotate", {}, format="json").status_code == 403
    client = APIClient()
    client.force_login(engineer)
    rotated = client.post(f"/api/v1/keys/{key.pk}/rotate", {"overlap_s": 60}, format="json")
    assert rotated.status_code == 201, rotated.json()
    body = rotated.json()
    new = ApiKey.objects.get(pk=body["id"])
    assert (new.name, new.scopes, new.priority) == ("svc", ["predict", "deploy"], 0)
    assert body["key"].startswith(f"sy_{new.prefix}_")
    assert key_client(body["key"]).get("/api/v1/models").status_code == 200
    assert key_client(old_raw).get("/api/v1/models").status_code == 200  # inside the overlap
    key.refresh_from_db()
    assert timedelta(seconds=55) < key.expires_at - timezone.now() <= timedelta(seconds=60)
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now())  # the overlap ends
    assert key_client(old_raw).get("/api/v1/models").status_code == 401
    event = AuditEvent.objects.get(action="key.rotate")
    assert event.after["successor"] == new.prefix and event.actor_id == engineer.pk
    again = client.post(f"/api/v1/keys/{key.pk}/rotate", {}, format="json")
    assert again.status_code == 409  # an expired key has nothing to rotate


@pytest.mark.django_db
def test_rotation_overlap_is_bounded(world):
    key, _ = make_key(world.a)
    with pytest.raises(ValueError, match="between 0 and"):
        rotate_api_key(key, overlap_s=10**9)


# the keys API ----------------------------------------------------------------------------------


def session(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_a_viewer_cannot_create_keys_and_an_engineer_cannot_create_admin_keys(world):
    viewer = session(world.viewer_a).post("/api/v1/keys/", {"name": "x"}, format="json")
    assert viewer.status_code == 403
    engineer = session(world.engineer_a)
    refused = engineer.post("/api/v1/keys/", {"name": "x", "scopes": ["admin"]}, format="json")
    assert refused.status_code == 403 and "admin" in refused.json()["error"]
    made = engineer.post("/api/v1/keys/", {"name": "app"}, format="json")
    assert made.status_code == 201 and made["Cache-Control"] == "no-store"
    body = made.json()
    assert body["scopes"] == ["predict"] and body["created_by"] == "eng-a"  # the default scope
    assert body["key"].startswith(f"sy_{body['prefix']}_")
    listed = engineer.get("/api/v1/keys").json()
    assert body["id"] in [k["id"] for k in listed]
    assert all("key" not in k and "key_hash" not in k for k in listed)  # never the secret
    assert AuditEvent.objects.filter(action="key.create", actor_id=world.engineer_a.pk).exists()


@pytest.mark.django_db
def test_an_approver_makes_an_admin_key_which_manages_keys_but_cannot_deploy(world, two_versions):
    approver = make_member(world.a, "appr", "approver")
    made = session(approver).post(
        "/api/v1/keys", {"name": "ops", "scopes": ["admin"]}, format="json"
    )
    assert made.status_code == 201
    admin = key_client(made.json()["key"])
    assert admin.get("/api/v1/keys").status_code == 200
    child = admin.post("/api/v1/keys", {"name": "child", "scopes": ["admin"]}, format="json")
    assert child.status_code == 201 and child.json()["created_by"] == "appr"
    # It gives only what it holds: no key that predicts or deploys (the escalation of a key).
    wider = admin.post("/api/v1/keys", {"name": "app", "scopes": ["predict"]}, format="json")
    assert wider.status_code == 403 and "this key" in wider.json()["error"]
    assert upload(admin, small_onnx(seed=5)).status_code == 403  # no deploy scope
    # A key without the admin scope cannot manage keys.
    refused = key_client(world.key_a).get("/api/v1/keys")
    assert refused.status_code == 403 and "'admin' scope" in refused.json()["error"]


# Who may give which scopes, written out (not derived from tenants.keys): a person by role, a
# key by role and by the scopes it holds itself.
MAY_GIVE = {
    "engineer": {"predict", "deploy"},
    "approver": {"predict", "deploy", "admin"},
    "approver's admin key": {"admin"},
    "approver's admin+predict key": {"admin", "predict"},
    "approver's admin+deploy key": {"admin", "deploy"},
}


@pytest.mark.django_db
def test_every_path_that_makes_a_key_gives_only_what_the_caller_holds(world):
    """Every path that creates a key or makes one anew (the API's create and rotate, the keys
    page's create and rotate), for every kind of caller and scope: given when the caller may
    hold it, else 403 and no key made."""
    approver = make_member(world.a, "appr", "approver")
    people = {"engineer": world.engineer_a, "approver": approver}
    keys = {
        name: make_key(world.a, name, scopes=tuple(MAY_GIVE[name]), creator=approver)[1]
        for name in MAY_GIVE
        if name not in people
    }

    def attempt(caller: str, scope: str, path: str):
        if path.startswith("api"):
            client = session(people[caller]) if caller in people else key_client(keys[caller])
        else:
            client = Client()
            client.force_login(people[caller])
        if path == "api create":
            return client.post("/api/v1/keys", {"name": "new", "scopes": [scope]}, format="json")
        if path == "page create":
            return client.post("/keys/create/", {"name": "new", "scopes": [scope]})
        # A key of its own to rotate (a rotated key cannot be rotated again).
        target, _ = make_key(world.a, "to rotate", scopes=(scope,), creator=approver)
        if path.startswith("api"):
            return client.post(f"/api/v1/keys/{target.pk}/rotate", {}, format="json")
        return client.post(f"/keys/{target.pk}/rotate/", {"overlap_h": "1"})

    for caller, may in MAY_GIVE.items():
        paths = ["api create", "api rotate"]
        if caller in people:  # the keys page is for people signed in
            paths += ["page create", "page rotate"]
        for scope in ("predict", "deploy", "admin"):
            for path in paths:
                before = ApiKey.objects.count() + path.endswith("rotate")  # its own target
                response = attempt(caller, scope, path)
                expected = 201 if scope in may else 403
                assert response.status_code == expected, (caller, scope, path)
                made = ApiKey.objects.count() - before
                assert made == (expected == 201), (caller, scope, path)


@pytest.mark.django_db
def test_the_keys_api_is_tenant_scoped(world):
    theirs, _ = make_key(world.b, "theirs")
    engineer = session(world.engineer_a)
    assert theirs.pk not in [k["id"] for k in engineer.get("/api/v1/keys").json()]
    for action in ("revoke", "rotate"):
        response = engineer.post(f"/api/v1/keys/{theirs.pk}/{action}", {}, format="json")
        assert response.status_code == 404, action
    theirs.refresh_from_db()
    assert theirs.is_active


@pytest.mark.django_db
def test_an_engineer_cannot_revoke_or_rotate_an_admin_key(world):
    approver = make_member(world.a, "appr", "approver")
    admin_key, _ = make_key(world.a, "ops", scopes=("admin",), creator=approver)
    engineer = session(world.engineer_a)
    assert engineer.post(f"/api/v1/keys/{admin_key.pk}/rotate", {}).status_code == 403
    assert engineer.post(f"/api/v1/keys/{admin_key.pk}/revoke").status_code == 403
    revoked = session(approver).post(f"/api/v1/keys/{admin_key.pk}/revoke")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field",
    [
        ({"name": "x", "scopes": ["root"]}, "scopes"),
        ({"name": "x", "scopes": []}, "scopes"),
        ({"name": ""}, "name"),
        ({"name": "x", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
    ],
)
def test_bad_key_requests_are_400_naming_the_field(world, body, field):
    response = session(world.engineer_a).post("/api/v1/keys", body, format="json")
    assert response.status_code == 400 and field in response.json()["error"]


# the keys page ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_keys_page_lists_creates_shows_once_rotates_and_revokes(world):
    browser = Client(enforce_csrf_checks=False)
    browser.force_login(world.engineer_a)
    page = browser.get("/keys/")
    assert page.status_code == 200 and b'href="/keys/"' in page.content
    made = browser.post("/keys/create/", {"name": "web app", "scopes": ["predict", "deploy"]})
    assert made.status_code == 201 and made["Cache-Control"] == "no-store"
    key = ApiKey.objects.get(name="web app")
    raw = made.context["shown"][1]
    assert raw.startswith(f"sy_{key.prefix}_") and raw.encode() in made.content
    assert key.scopes == ["predict", "deploy"] and key.created_by == world.engineer_a
    listed = browser.get("/keys/")
    assert b"web app" in listed.content and raw.encode() not in listed.content  # shown once
    refused = browser.post("/keys/create/", {"name": "x", "scopes": ["admin"]})
    assert refused.status_code == 403 and b"admin" in refused.content
    rotated = browser.post(f"/keys/{key.pk}/rotate/", {"overlap_h": "1"})
    assert rotated.status_code == 201
    assert ApiKey.objects.filter(name="web app").count() == 2
    assert browser.post(f"/keys/{key.pk}/revoke/").status_code == 302
    key.refresh_from_db()
    assert key.state == "revoked"
    assert browser.post("/keys/999999/revoke/").status_code == 404


@pytest.mark.django_db
def test_a_viewer_sees_the_keys_page_without_forms(world):
    browser = Client()
    browser.force_login(world.viewer_a)
    page = browser.get("/keys/")
    assert page.status_code == 200 and b'id="key-create"' not in page.content
    assert browser.post("/keys/create/", {"name": "x", "scopes": ["predict"]}).status_code == 403
    assert not ApiKey.objects.filter(name="x").exists()


@pytest.mark.django_db
def test_the_keys_page_posts_need_csrf(world):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(world.engineer_a)
    assert browser.post("/keys/create/", {"name": "x"}).status_code == 403


@pytest.mark.django_db(transaction=True)
def test_keys_made_before_scopes_keep_predict_and_deploy_and_events_get_their_slug():
    before_scopes = [("tenants", "0008_idempotency_record")]
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    executor.migrate(before_scopes)
    executor.loader.build_graph()
    old = executor.loader.project_state(before_scopes).apps
    tenant = old.get_model("tenants", "Tenant").objects.create(name="Old", slug="old")
    old.get_model("tenants", "ApiKey").objects.create(
        tenant=tenant, name="k", prefix="p1", key_hash="h" * 64
    )
    old.get_model("tenants", "AuditEvent").objects.create(
        tenant=tenant, actor_label="system", action="key.create", target="k"
    )
    executor.migrate(latest)
    assert ApiKey.objects.get(prefix="p1").scopes == ["predict", "deploy"]
    assert AuditEvent.objects.get(target="k").tenant_slug == "old"


@pytest.mark.django_db
def test_create_tenant_makes_a_key_acting_as_its_owner():
    from io import StringIO

    from django.core.management import CommandError, call_command

    out = StringIO()
    call_command(
        "create_tenant",
        "acme",
        "--owner",
        "ann",
        "--scopes",
        "predict,deploy",
        "--json",
        stdout=out,
    )
    identity = identify_key(json.loads(out.getvalue())["api_key"])
    owner = Membership.objects.get(tenant__slug="acme")
    assert (owner.user.username, owner.role) == ("ann", "engineer")
    assert identity.created_by_id == owner.user_id and identity.scopes == {"predict", "deploy"}
    with pytest.raises(CommandError, match="unknown scope"):
        call_command("create_tenant", "other", "--scopes", "root", stdout=StringIO())


@pytest.mark.django_db(transaction=True)
def test_a_key_without_predict_cannot_open_a_generation_socket(world, monkeypatch):
    from gateway import generate_ws
    from tests.test_generation import socket

    gateway = GatewayState()
    monkeypatch.setattr(generate_ws, "get_state", lambda: gateway)
    _, deploy_only = make_key(world.a, "ci", scopes=("deploy",))

    async def scenario():
        async with socket(deploy_only) as ws:
            return await ws.receive_json_from(timeout=5), await ws.receive_output(timeout=5)

    refused, closed = async_to_sync(scenario)()
    assert refused["code"] == "forbidden" and "'predict' scope" in refused["message"]
    assert closed["type"] == "websocket.close"
