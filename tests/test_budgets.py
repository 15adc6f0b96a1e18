"""Monthly budgets: thresholds alert once per month, a hard stop refuses new work on every front
door (OIP REST and gRPC, OpenAI, the prediction API, the generation websocket) with a 429
naming the budget, an approver's override lifts it; the budget API's validation, roles,
tenant isolation and audit."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from monitoring import budgets, usage
from monitoring.models import Alert, AlertKind, Budget, UsageDay
from tenants.audit import Actor
from tenants.models import AuditEvent
from tests.factories import as_user, key_client, make_key, make_member, make_model, make_version
from tests.test_front_door_limits import OIP_BODY, PREDICT_BODY, HeldAgent, openai_call, send
from tests.test_front_door_limits import state as state  # noqa: F401 (a fixture)
from tests.test_generation import make_textgen, socket
from tests.test_grpc_server import X, bearer, infer_request, serve
from tests.test_grpc_server import site as site  # noqa: F401 (a fixture)

pytestmark = pytest.mark.backends

REFUSED = "monthly budget of 100.00 USD spent (103.20 USD); an approver can override"


def today() -> date:
    return timezone.now().astimezone(UTC).date()


def spend(tenant, version, cost: str, day: date | None = None) -> None:
    UsageDay.objects.update_or_create(
        version=version,
        day=day or today(),
        defaults={"tenant": tenant, "model": version.model, "cost": Decimal(cost)},
    )


def approver(tenant):
    return make_member(tenant, f"approver-{tenant.slug}", "approver")


def boss_of(tenant) -> Actor:
    user = approver(tenant)
    return Actor(user.pk, user.username, "approver")


@pytest.fixture
def stopped(world, onnx_bytes):
    """Tenant A over its hard budget (103.20 of 100), B serving freely; A's stop is read."""
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    spend(world.a, version, "103.20")
    boss = boss_of(world.a)
    budgets.set_budget(world.a.pk, {"monthly_limit": 100, "hard_stop": True}, boss)
    return version, boss


# Thresholds and the stop -------------------------------------------------------------------------


@pytest.mark.django_db
def test_each_threshold_alerts_once_a_month(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    boss = boss_of(world.a)
    budgets.set_budget(world.a.pk, {"monthly_limit": "10", "thresholds": [50, 80, 100]}, boss)
    spend(world.a, version, "6")
    usage.roll_up()
    usage.roll_up()
    assert list(Alert.objects.values_list("key", flat=True)) == [f"budget:{today():%Y-%m}:50"]
    spend(world.a, version, "12")
    usage.roll_up()
    alerts = Alert.objects.filter(kind=AlertKind.BUDGET)
    assert sorted(a.details["threshold"] for a in alerts) == [50, 80, 100]
    assert alerts.get(details__threshold=100).severity == "critical"
    Alert.objects.update(resolved_at=timezone.now())  # resolved by hand: still not again
    usage.roll_up()
    assert Alert.objects.count() == 3
    budget = Budget.objects.get()
    assert budget.alerted == [50, 80, 100] and not budget.stopped  # no hard stop asked


@pytest.mark.django_db
def test_a_new_month_alerts_again(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    budgets.set_budget(world.a.pk, {"monthly_limit": "10", "thresholds": [50]}, boss_of(world.a))
    first = date(2026, 10, 31)
    spend(world.a, version, "6", first)
    budgets.evaluate_budgets(first)
    spend(world.a, version, "6", date(2026, 11, 1))
    budgets.evaluate_budgets(date(2026, 11, 1))
    assert sorted(Alert.objects.values_list("key", flat=True)) == [
        "budget:2026-10:50",
        "budget:2026-11:50",
    ]


@pytest.mark.django_db
def test_a_hard_stop_past_100_percent_is_audited_and_read_by_the_gateways(world, stopped):
    assert budgets.stopped_tenants() == {world.a.pk: REFUSED}
    assert AuditEvent.objects.filter(action="budget.set", tenant=world.a).count() == 1
    budgets.set_budget(world.a.pk, {"monthly_limit": 200, "hard_stop": True}, stopped[1])
    assert budgets.stopped_tenants() == {}  # a raised limit lifts it at once
    assert AuditEvent.objects.filter(action="budget.resume").count() == 1


# The refusal on every front door ------------------------------------------------------------------


def read_stops(state) -> None:
    """What the refresh loop does every SWITCHYARD_BUDGET_REFRESH_S."""
    state.budget_stops = budgets.stopped_tenants()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path, body",
    [("/v2/models/clf/infer", OIP_BODY), ("/api/v1/models/clf/predict", PREDICT_BODY)],
    ids=["oip", "prediction-api"],
)
def test_a_stopped_tenants_inference_is_429_naming_the_budget(world, state, stopped, path, body):
    read_stops(state)
    status, headers, error = async_to_sync(send)(path, body, world.key_a)
    assert status == 429 and headers["retry-after"] == "3600"
    assert REFUSED in json.dumps(error)


@pytest.mark.django_db
def test_another_tenant_is_not_stopped(world, state, stopped, onnx_bytes):
    version = make_version(make_model(world.b, "clf"), onnx_bytes)
    read_stops(state)

    async def scenario():
        import asyncio

        agent = HeldAgent(state, version.pk)
        call = asyncio.ensure_future(send("/v2/models/clf/infer", OIP_BODY, world.key_b))
        while not agent.held:
            await asyncio.sleep(0.01)
        agent.answer_all()
        return await call

    assert async_to_sync(scenario)()[0] == 200


@pytest.mark.django_db(transaction=True)
def test_a_stopped_tenants_openai_call_is_429_in_openais_shape(world, state, onnx_bytes):
    version = make_textgen(make_model(world.a, "writer", task="generator"))
    spend(world.a, version, "103.20")
    budgets.set_budget(world.a.pk, {"monthly_limit": 100, "hard_stop": True}, boss_of(world.a))
    read_stops(state)
    body = {"model": "writer", "prompt": "hello", "max_tokens": 5}
    response = async_to_sync(openai_call(world.key_a, body))()
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["message"] == REFUSED


@pytest.mark.django_db(transaction=True)
def test_a_stopped_tenants_generation_socket_is_refused_with_the_budget(world, state):
    version = make_textgen(make_model(world.a, "writer", task="generator"))
    spend(world.a, version, "103.20")
    budgets.set_budget(world.a.pk, {"monthly_limit": 100, "hard_stop": True}, boss_of(world.a))
    read_stops(state)

    async def scenario():
        async with socket(world.key_a) as ws:
            await ws.send_json_to({"type": "generate", "id": "g", "prompt": "hi"})
            return await ws.receive_json_from(timeout=5)

    frame = async_to_sync(scenario)()
    assert frame["type"] == "error" and frame["id"] == "g"
    assert frame["message"] == REFUSED and frame["code"] == "rate_limited"


@pytest.mark.django_db(transaction=True)
@pytest.mark.db_threads
def test_a_stopped_tenants_grpc_call_is_resource_exhausted(site):  # noqa: F811
    import grpc
    import tritonclient.grpc.service_pb2_grpc as triton_grpc

    from registry.models import ModelVersion

    version = ModelVersion.objects.get(pk=site.version_id)
    spend(version.model.tenant, version, "103.20")
    budgets.set_budget(
        version.model.tenant_id,
        {"monthly_limit": 100, "hard_stop": True},
        boss_of(version.model.tenant),
    )

    stops = budgets.stopped_tenants()

    async def scenario(address: str):
        site.state.budget_stops = stops  # as the refresh loop reads them
        async with grpc.aio.insecure_channel(address) as channel:
            stub = triton_grpc.GRPCInferenceServiceStub(channel)
            try:
                await stub.ModelInfer(infer_request(X), metadata=bearer(site.key_a))
            except grpc.aio.AioRpcError as error:
                return error
        raise AssertionError("the call was not refused")

    refused = serve(site, scenario, agent=False)
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details() == REFUSED


@pytest.mark.django_db(transaction=True)
def test_the_refresh_loop_picks_up_a_stop_and_its_override(world, state, stopped, settings):
    settings.SWITCHYARD_BUDGET_REFRESH_S = 0
    async_to_sync(state.refresh_once)()
    assert state.budget_stops == {world.a.pk: REFUSED}
    until = timezone.now() + timedelta(minutes=5)
    budgets.override(world.a.pk, stopped[1], "quarter-end batch", until.isoformat())
    async_to_sync(state.refresh_once)()
    assert state.budget_stops == {}


# The override -----------------------------------------------------------------------------------


def month_end() -> datetime:
    return budgets.month_end(timezone.now())


@pytest.mark.django_db
def test_an_approvers_override_lifts_the_stop_until_it_ends_audited(world, stopped):
    user = approver_user(world)
    client = as_user(user)
    until = min(month_end(), timezone.now() + timedelta(hours=1))
    response = client.post(
        "/api/v1/budget/override", {"reason": "launch week", "until": until.isoformat()}
    )
    assert response.status_code == 200, response.json()
    assert response.json()["stopped"] is False
    assert budgets.stopped_tenants() == {}
    event = AuditEvent.objects.get(action="budget.override")
    assert event.reason == "launch week" and event.actor_id == user.pk
    usage.roll_up()  # still overridden: the roll-up does not stop it again
    assert budgets.stopped_tenants() == {}
    Budget.objects.update(override_until=timezone.now() - timedelta(seconds=1))
    usage.roll_up()  # the override ended
    assert budgets.stopped_tenants() == {world.a.pk: REFUSED}
    assert AuditEvent.objects.filter(action="budget.stop").count() == 1


def approver_user(world):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.get(username=f"approver-{world.a.slug}")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field",
    [
        ({"until": "+1h"}, "reason"),
        ({"reason": "  ", "until": "+1h"}, "reason"),
        ({"reason": "x" * 501, "until": "+1h"}, "reason"),
        ({"reason": "r", "until": "tomorrow"}, "until"),
        ({"reason": "r", "until": "2020-01-01T00:00:00Z"}, "until"),
        ({"reason": "r", "until": "2999-01-01T00:00:00Z"}, "until"),
        ({"reason": "r", "until": "2026-11-27T10:00:00"}, "until"),
        ({"reason": "r"}, "until"),
    ],
)
def test_bad_overrides_are_400_naming_the_field(world, stopped, body, field):
    if body.get("until") == "+1h":
        body["until"] = (timezone.now() + timedelta(minutes=5)).isoformat()
    response = as_user(approver_user(world)).post("/api/v1/budget/override", body)
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"{field}:")
    assert budgets.stopped_tenants() == {world.a.pk: REFUSED}


@pytest.mark.django_db
def test_an_override_without_a_budget_is_400(world):
    boss = approver(world.b)
    until = (timezone.now() + timedelta(minutes=5)).isoformat()
    response = as_user(boss, "beta").post(
        "/api/v1/budget/override", {"reason": "r", "until": until}
    )
    assert response.status_code == 400 and response.json()["error"].startswith("budget:")


@pytest.mark.django_db
def test_only_approvers_override_or_set_the_budget(world, stopped):
    until = (timezone.now() + timedelta(minutes=5)).isoformat()
    override = {"reason": "r", "until": until}
    for client in (as_user(world.engineer_a), as_user(world.viewer_a), key_client(world.key_a)):
        assert client.post("/api/v1/budget/override", override).status_code == 403
        assert client.put("/api/v1/budget", {"monthly_limit": 5}).status_code == 403
    assert budgets.stopped_tenants() == {world.a.pk: REFUSED}
    _, admin_key = make_key(world.a, "admin", scopes=("admin",), creator=approver_user(world))
    assert key_client(admin_key).post("/api/v1/budget/override", override).status_code == 200


# The budget API ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_budget_reads_this_months_spend_for_the_callers_tenant_only(world, stopped):
    mine = as_user(world.viewer_a).get("/api/v1/budget").json()
    assert mine["monthly_limit"] == "100.00" and mine["spent"] == "103.200000"
    assert mine["percent"] == 103.2 and mine["stopped"] is True and mine["hard_stop"] is True
    theirs = key_client(world.key_b).get("/api/v1/budget").json()
    assert theirs["monthly_limit"] is None and theirs["spent"] == "0.000000"
    # Tenant B's approver cannot touch A's budget: B's own is set instead.
    boss_b = approver(world.b)
    as_user(boss_b, "beta").put("/api/v1/budget", {"monthly_limit": 7})
    assert Budget.objects.get(tenant=world.a).monthly_limit == Decimal("100.00")
    assert Budget.objects.get(tenant=world.b).monthly_limit == Decimal("7.00")


@pytest.mark.django_db
def test_an_approver_sets_the_budget_audited(world):
    client = as_user(approver(world.a))
    body = {"monthly_limit": "250.5", "thresholds": [90, 50, 90], "hard_stop": True}
    response = client.put("/api/v1/budget", body)
    assert response.status_code == 200
    got = response.json()
    assert (got["monthly_limit"], got["thresholds"], got["hard_stop"]) == ("250.50", [50, 90], True)
    event = AuditEvent.objects.get(action="budget.set")
    assert event.before == {} and event.after["monthly_limit"] == "250.50"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "monthly_limit"),
        ({"monthly_limit": -5}, "monthly_limit"),
        ({"monthly_limit": 0}, "monthly_limit"),
        ({"monthly_limit": "lots"}, "monthly_limit"),
        ({"monthly_limit": "NaN"}, "monthly_limit"),
        ({"monthly_limit": True}, "monthly_limit"),
        ({"monthly_limit": 1e20}, "monthly_limit"),
        ({"monthly_limit": 5, "thresholds": "50"}, "thresholds"),
        ({"monthly_limit": 5, "thresholds": [0]}, "thresholds"),
        ({"monthly_limit": 5, "thresholds": [50.5]}, "thresholds"),
        ({"monthly_limit": 5, "thresholds": list(range(1, 20))}, "thresholds"),
        ({"monthly_limit": 5, "hard_stop": "yes"}, "hard_stop"),
        ({"monthly_limit": 5, "currency": "dollars"}, "currency"),
        ({"monthly_limit": 5, "colour": "red"}, "colour"),
    ],
)
def test_bad_budgets_are_400_naming_the_field(world, body, field):
    response = as_user(approver(world.a)).put("/api/v1/budget", body)
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"{field}:")
    assert not Budget.objects.exists()


@pytest.mark.django_db
def test_fuzzed_budget_requests_never_answer_5xx(world, rng):
    client = as_user(approver(world.a))
    junk = [None, "", 0, -1, 1.5, "1e999", [], {}, [50], "\u0000", True, "x" * 300, 10**30]
    for _ in range(80):
        a, b, c, d = (junk[i] for i in rng.integers(0, len(junk), 4))
        body = {"monthly_limit": a, "thresholds": b, "hard_stop": c}
        assert client.put("/api/v1/budget", body).status_code < 500
        override = {"reason": a, "until": d}
        assert client.post("/api/v1/budget/override", override).status_code < 500
    bad = client.generic("PUT", "/api/v1/budget", b"[1, 2", "application/json")
    assert bad.status_code == 400
    array = client.generic("PUT", "/api/v1/budget", b"[1, 2]", "application/json")
    assert array.status_code == 400
