"""Usage metering and chargeback: requests, rows and tokens counted in process with the traffic
samples, compute from heartbeat deltas, the idempotent roll-up priced by the tenant's or the
platform's prices, the CSV export, and the usage and prices API (validation, fuzz, roles,
tenant isolation, audit)."""

from __future__ import annotations

import asyncio
import csv
import io
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from fleet.nodes import create_node, record_heartbeat
from monitoring import usage
from monitoring.models import ComputeDay, Price, TrafficSample, UsageDay
from monitoring.traffic import save_samples
from tenants.audit import Actor
from tenants.models import AuditEvent
from tests.factories import (
    as_user,
    key_client,
    make_key,
    make_member,
    make_model,
    make_session,
    make_version,
)
from tests.test_front_door_limits import OIP_BODY, HeldAgent, send
from tests.test_front_door_limits import state as state  # noqa: F401 (a fixture)
from tests.test_generation import FakeAgent, frames_until_end, make_textgen, socket

pytestmark = pytest.mark.backends

TODAY = date(2026, 11, 20)
NOON = datetime(2026, 11, 20, 12, tzinfo=UTC)


def sample(version, *, requests=0, errors=0, rows=0, tokens_in=0, tokens_out=0, at=NOON):
    return TrafficSample.objects.create(
        version=version,
        window_end=at,
        requests=requests,
        errors=errors,
        latency_buckets=[0] * 15,
        rows=rows,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
    )


def approver(tenant, name: str = "appr"):
    return make_member(tenant, f"{name}-{tenant.slug}", "approver")


def actor(user, role: str = "approver") -> Actor:
    return Actor(user.pk, user.username, role)


# Counting on the gateway ------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_gateway_counts_requests_and_rows_answered_per_version(world, state, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    three_rows = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4], "data": [0] * 12}]}

    async def scenario():
        agent = HeldAgent(state, version.pk)
        calls = [
            asyncio.ensure_future(send("/v2/models/clf/infer", body, world.key_a))
            for body in (three_rows, OIP_BODY)
        ]
        while len(agent.held) < 2:
            await asyncio.sleep(0.01)
        agent.answer_all()
        return await asyncio.gather(*calls)

    answered = async_to_sync(scenario)()
    assert [a[0] for a in answered] == [200, 200]
    counts = state.traffic.drain()
    (entry,) = counts.values()
    assert (entry.requests, entry.rows, entry.tokens_in, entry.tokens_out) == (2, 4, 0, 0)
    save_samples(counts)
    stored = TrafficSample.objects.get(version=version)
    assert (stored.requests, stored.rows) == (2, 4)


@pytest.mark.django_db(transaction=True)
def test_a_generation_counts_its_prompt_and_generated_tokens(world, state):
    version = make_textgen(make_model(world.a, "writer", task="generator"))

    async def scenario():
        FakeAgent(state, version.pk)
        async with socket(world.key_a) as ws:
            await ws.send_json_to(
                {"type": "generate", "id": "g", "prompt": "hello", "max_tokens": 4}
            )
            return await frames_until_end(ws, "g")

    frames = async_to_sync(scenario)()
    assert frames[-1]["type"] == "done"
    (entry,) = state.traffic.drain().values()
    assert (entry.requests, entry.tokens_in, entry.tokens_out) == (1, 5, 4)


# Compute from heartbeats ------------------------------------------------------------------------


def beat(*loads: tuple[int, float, float]) -> dict:
    return {
        "versions": [
            {"version_id": v, "cpu_s_total": cpu, "accel_s_total": accel} for v, cpu, accel in loads
        ]
    }


def test_deltas_count_since_the_previous_heartbeat_and_a_reload_in_full() -> None:
    assert usage.compute_deltas({}, beat((1, 5.0, 0.0))) == {}  # a session's first: baseline
    deltas = usage.compute_deltas(beat((1, 5.0, 1.0)), beat((1, 7.5, 1.5), (2, 0.25, 0.0)))
    assert deltas == {1: (2.5, 0.5), 2: (0.25, 0.0)}  # version 2 loaded since: in full
    assert usage.compute_deltas(beat((1, 5.0, 0.0)), beat((1, 0.5, 0.0))) == {1: (0.5, 0.0)}


@pytest.mark.parametrize(
    "claim", [-1.0, float("nan"), float("inf"), 1e12, "5", None, True], ids=repr
)
def test_hostile_compute_claims_count_nothing(claim) -> None:
    current = {"versions": [{"version_id": 1, "cpu_s_total": claim, "accel_s_total": claim}]}
    assert usage.compute_deltas(beat((1, 0.0, 0.0)), current) == {}


@pytest.mark.django_db
def test_stored_heartbeats_add_their_versions_compute_to_the_day(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    node, _ = create_node("n1", tenant=None)
    session = make_session(node)
    record_heartbeat(session.pk, node.pk, beat((version.pk, 1.0, 0.0)))  # the baseline
    record_heartbeat(session.pk, node.pk, beat((version.pk, 3.5, 0.0), (999_999, 9.0, 0.0)))
    record_heartbeat(session.pk, node.pk, beat((version.pk, 4.0, 0.0)))
    (row,) = ComputeDay.objects.all()
    assert row.version_id == version.pk and row.cpu_s == pytest.approx(3.0)
    assert row.day == timezone.now().astimezone(UTC).date()


# Roll-up and prices -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_roll_up_sums_the_sources_and_prices_them(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    sample(version, requests=10, errors=2, rows=40)
    sample(version, requests=5, rows=5, tokens_in=7, tokens_out=9)
    sample(version, requests=100, at=NOON - timedelta(days=1))  # yesterday's own row
    sample(version, requests=1000, at=NOON - timedelta(days=5))  # outside the roll-up
    ComputeDay.objects.create(version=version, day=TODAY, cpu_s=2.5, accel_s=0.5)
    boss = approver(world.a)
    usage.set_prices(world.a.pk, {"request": "0.01", "cpu_second": "0.1"}, actor(boss))
    usage.set_prices(None, {"request": "5", "row": "0.001"}, Actor(None, "operator"))
    usage.roll_up(TODAY)
    today = UsageDay.objects.get(day=TODAY)
    assert (today.requests, today.rows, today.tokens_in, today.tokens_out) == (13, 45, 7, 9)
    assert (today.cpu_s, today.accel_s) == (2.5, 0.5)
    assert (today.tenant_id, today.model_id) == (world.a.pk, version.model_id)
    # The tenant's request price wins over the default; the default row price applies.
    assert today.cost == Decimal("13") * Decimal("0.01") + 45 * Decimal("0.001") + Decimal("0.25")
    assert UsageDay.objects.get(day=TODAY - timedelta(days=1)).requests == 100
    assert not UsageDay.objects.filter(day=TODAY - timedelta(days=5)).exists()


@pytest.mark.django_db
def test_the_roll_up_twice_changes_nothing(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    sample(version, requests=3, rows=3)
    usage.set_prices(None, {"row": "0.5"}, Actor(None, "operator"))
    assert usage.roll_up(TODAY)["changed"] == 1
    before = list(UsageDay.objects.values())
    assert usage.roll_up(TODAY)["changed"] == 0
    assert list(UsageDay.objects.values()) == before
    sample(version, requests=1, rows=2)  # a new sample: the row follows
    usage.roll_up(TODAY)
    row = UsageDay.objects.get()
    assert (row.requests, row.rows, row.cost) == (4, 5, Decimal("2.5"))


@pytest.mark.django_db
def test_without_any_price_usage_costs_nothing(world, onnx_bytes):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    sample(version, requests=3, rows=3)
    usage.roll_up(TODAY)
    assert UsageDay.objects.get().cost == 0


# The API ----------------------------------------------------------------------------------------


@pytest.fixture
def usage_rows(world, onnx_bytes):
    a = make_version(make_model(world.a, "clf"), onnx_bytes)
    b = make_version(make_model(world.b, "other"), onnx_bytes)
    today = timezone.now().astimezone(UTC).date()
    for day, n in ((today, 4), (today - timedelta(days=1), 6)):
        UsageDay.objects.create(
            tenant=world.a, model=a.model, version=a, day=day, requests=n, rows=2 * n, cost=n
        )
    UsageDay.objects.create(
        tenant=world.b, model=b.model, version=b, day=today, requests=99, cost=99
    )
    return a, b


@pytest.mark.django_db
def test_usage_groups_by_day_model_and_version_for_the_callers_tenant_only(world, usage_rows):
    client = as_user(world.viewer_a)
    by_day = client.get("/api/v1/usage?group=day").json()
    assert [r["requests"] for r in by_day["rows"]] == [6, 4]
    assert by_day["total"]["requests"] == 10 and by_day["total"]["cost"] == "10.000000"
    (by_model,) = client.get("/api/v1/usage?group=model").json()["rows"]
    assert by_model == by_model | {"model": "clf", "requests": 10, "rows": 20}
    (by_version,) = client.get("/api/v1/usage?group=version").json()["rows"]
    assert (by_version["model"], by_version["version"]) == ("clf", 1)
    other = key_client(world.key_b).get("/api/v1/usage").json()
    assert other["total"]["requests"] == 99  # tenant B sees only its own


@pytest.mark.django_db
def test_the_csv_export_has_one_line_per_day_and_version(world, usage_rows):
    response = as_user(world.viewer_a).get("/api/v1/usage/export?format=csv")
    assert response.status_code == 200 and response["Content-Type"] == "text/csv"
    lines = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(line["tenant"], line["model"], line["requests"]) for line in lines] == [
        ("alpha", "clf", "6"),
        ("alpha", "clf", "4"),
    ]
    assert set(lines[0]) == set(usage.CSV_FIELDS)


@pytest.mark.django_db
def test_operators_see_every_tenant_and_members_may_not(world, usage_rows, admin_user):
    response = as_user(world.viewer_a).get("/api/v1/usage?all=1")
    assert response.status_code == 403
    assert key_client(world.key_a).get("/api/v1/usage/export?all=1").status_code == 403
    client = as_user(admin_user)
    everyone = client.get("/api/v1/usage?all=1&group=model").json()
    assert {(r["tenant"], r["requests"]) for r in everyone["rows"]} == {
        ("alpha", 10),
        ("beta", 99),
    }
    lines = client.get("/api/v1/usage/export?all=1").content.decode().splitlines()
    assert len(lines) == 4 and any(line.startswith("beta,") for line in lines)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query, field",
    [
        ("start=yesterday", "start"),
        ("end=2026-13-01", "end"),
        ("start=2026-11-10&end=2026-11-01", "end"),
        ("start=2020-01-01&end=2026-01-01", "end"),
        ("group=tenant", "group"),
        ("start=" + "9" * 5000, "start"),
    ],
)
def test_bad_windows_and_groups_are_400_naming_the_field(world, query, field):
    response = as_user(world.viewer_a).get(f"/api/v1/usage?{query}")
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"{field}:")


@pytest.mark.django_db
def test_an_export_in_another_format_is_400(world):
    response = as_user(world.viewer_a).get("/api/v1/usage/export?format=xlsx")
    assert response.status_code == 400 and response.json()["error"].startswith("format:")


@pytest.mark.django_db
def test_an_approver_sets_prices_audited_and_a_null_removes_one(world):
    boss = approver(world.a)
    client = as_user(boss)
    response = client.put("/api/v1/usage/prices", {"prices": {"row": 0.002, "request": "1"}})
    assert response.status_code == 200
    assert response.json()["prices"] == {"request": "1.000000000", "row": "0.002000000"}
    event = AuditEvent.objects.get(action="usage.prices")
    assert event.tenant_id == world.a.pk and event.after["row"] == "0.002000000"
    client.put("/api/v1/usage/prices", {"prices": {"request": None}})
    assert set(usage.prices_of(world.a.pk)) == {"row"}
    assert Price.objects.filter(tenant=world.b).count() == 0  # another tenant untouched
    effective = client.get("/api/v1/usage/prices").json()["effective"]
    assert effective["row"] == "0.002000000" and effective["request"] == "0"


@pytest.mark.django_db
def test_only_approvers_set_prices(world):
    body = {"prices": {"row": 1}}
    assert as_user(world.engineer_a).put("/api/v1/usage/prices", body).status_code == 403
    assert as_user(world.viewer_a).put("/api/v1/usage/prices", body).status_code == 403
    assert key_client(world.key_a).put("/api/v1/usage/prices", body).status_code == 403
    boss = approver(world.a)
    _, admin_key = make_key(world.a, "admin", scopes=("admin",), creator=boss)
    assert key_client(admin_key).put("/api/v1/usage/prices", body).status_code == 200
    assert not AuditEvent.objects.filter(action="usage.prices", actor_id=world.engineer_a.pk)


@pytest.mark.django_db
def test_operators_set_the_default_prices_with_the_flag(world, admin_user):
    body = {"prices": {"cpu_second": "0.05"}}
    assert as_user(approver(world.a)).put("/api/v1/usage/prices?default=1", body).status_code == 403
    response = as_user(admin_user).put("/api/v1/usage/prices?default=1", body)
    assert response.status_code == 200 and response.json()["defaults"] == {
        "cpu_second": "0.050000000"
    }
    event = AuditEvent.objects.get(action="usage.default_prices")
    assert event.tenant_id is None and event.actor_id == admin_user.pk


@pytest.mark.django_db
def test_the_admin_sets_a_default_price_through_the_same_rules(admin_client):
    response = admin_client.post(
        "/admin/monitoring/price/add/", {"resource": "row", "unit_price": "0.25"}
    )
    assert response.status_code == 302
    assert usage.prices_of(None) == {"row": Decimal("0.25")}
    assert AuditEvent.objects.filter(action="usage.default_prices").count() == 1
    refused = admin_client.post(
        "/admin/monitoring/price/add/", {"resource": "row", "unit_price": "-1"}
    )
    assert refused.status_code == 200  # the form again, with the error
    assert usage.prices_of(None) == {"row": Decimal("0.25")}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "prices, field",
    [
        ({"row": -0.01}, "prices.row"),
        ({"gpu_hour": 1}, "prices.gpu_hour"),
        ({"row": "abc"}, "prices.row"),
        ({"row": "NaN"}, "prices.row"),
        ({"row": "Infinity"}, "prices.row"),
        ({"row": True}, "prices.row"),
        ({"row": [1]}, "prices.row"),
        ({"row": 1e30}, "prices.row"),
        ([1, 2], "prices"),
        ("cheap", "prices"),
    ],
)
def test_bad_prices_are_400_naming_the_field_and_change_nothing(world, prices, field):
    response = as_user(approver(world.a)).put("/api/v1/usage/prices", {"prices": prices})
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"{field}:")
    assert not Price.objects.exists() and not AuditEvent.objects.filter(action="usage.prices")


@pytest.mark.django_db
def test_fuzzed_usage_and_price_requests_never_answer_5xx(world, rng):
    client = as_user(approver(world.a))
    junk = ["", "0", "-1", "1e999", "null", "[]", "{}", "\u0000", "2026-02-30", "x" * 300]
    for _ in range(60):
        a, b, c = (junk[i] for i in rng.integers(0, len(junk), 3))
        assert client.get(f"/api/v1/usage?start={a}&end={b}&group={c}").status_code < 500
        assert client.get(f"/api/v1/usage/export?start={a}&format={c}").status_code < 500
        body = {"prices": {a: b}} if rng.random() < 0.7 else {a: b}
        assert client.put("/api/v1/usage/prices", body).status_code < 500
    raw = client.generic("PUT", "/api/v1/usage/prices", b"{not json", "application/json")
    assert raw.status_code == 400


@pytest.mark.django_db
def test_the_usage_api_needs_a_member(world):
    from tests.factories import as_user as signed_in

    assert signed_in(world.outsider).get("/api/v1/usage").status_code == 403


# The usage page ---------------------------------------------------------------------------------


def signed_in(user):
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_the_usage_page_shows_the_tenants_usage_charts_and_export(world, usage_rows):
    response = signed_in(world.viewer_a).get("/usage/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="cost-chart"' in html and 'id="usage-series"' in html
    assert "/api/v1/usage/export?format=csv" in html and "tenant=alpha" in html
    assert ">clf<" in html and "99" not in response.context["total"].values()
    assert response.context["total"]["requests"] == 10
    export = signed_in(world.viewer_a).get(response.context["export_url"])  # the link works
    assert export.status_code == 200 and export.content.decode().count("alpha,") == 2
    assert 'href="/usage/"' in html  # the nav link
    assert "Every tenant" not in html  # operators only


@pytest.mark.django_db
def test_operators_see_every_tenant_on_the_page(world, usage_rows, admin_user):
    from tenants.models import Membership

    Membership.objects.create(tenant=world.a, user=admin_user, role="viewer")
    response = signed_in(admin_user).get("/usage/?all=1")
    assert response.context["everyone"] is True
    assert response.context["total"]["requests"] == 109
    assert "all=1" in response.context["export_url"]
    own = signed_in(world.viewer_a).get("/usage/?all=1")  # not staff: the flag is ignored
    assert own.context["everyone"] is False and own.context["total"]["requests"] == 10


@pytest.mark.django_db
def test_the_override_button_lifts_the_stop_for_approvers_only(world, onnx_bytes):
    from monitoring import budgets

    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    UsageDay.objects.create(
        tenant=world.a,
        model=version.model,
        version=version,
        day=timezone.now().astimezone(UTC).date(),
        cost=50,
    )
    boss = approver(world.a)
    budgets.set_budget(world.a.pk, {"monthly_limit": 10, "hard_stop": True}, actor(boss))
    page = signed_in(boss).get("/usage/").content.decode()
    assert "data-budget-stopped" in page and "data-override" in page
    until = min(budgets.month_end(timezone.now()), timezone.now() + timedelta(hours=1))
    form = {"reason": "demo day", "until": until.astimezone(UTC).strftime("%Y-%m-%dT%H:%M")}
    assert signed_in(world.engineer_a).post("/usage/override/", form).status_code == 403
    assert budgets.stopped_tenants() != {}
    bad = signed_in(boss).post("/usage/override/", {"reason": "x", "until": "soon"})
    assert bad.status_code == 400 and "until" in bad.context["errors"]
    if until <= timezone.now() + timedelta(minutes=1):
        pytest.skip("the month ends within a minute")
    done = signed_in(boss).post("/usage/override/", form)
    assert done.status_code == 302 and budgets.stopped_tenants() == {}
    assert AuditEvent.objects.get(action="budget.override").reason == "demo day"


@pytest.mark.django_db
def test_prices_are_the_callers_tenants_only(world):
    usage.set_prices(world.a.pk, {"row": "3"}, actor(approver(world.a)))
    boss_b = approver(world.b)
    seen = as_user(boss_b, "beta").get("/api/v1/usage/prices").json()
    assert seen["prices"] == {} and seen["effective"]["row"] == "0"
    as_user(boss_b, "beta").put("/api/v1/usage/prices", {"prices": {"row": "1"}})
    assert usage.prices_of(world.a.pk) == {"row": Decimal("3")}
    assert usage.prices_of(world.b.pk) == {"row": Decimal("1")}


@pytest.mark.django_db
def test_the_beat_runs_the_roll_up_on_its_interval(world, onnx_bytes):
    from django.conf import settings as conf

    from monitoring import tasks

    entry = conf.CELERY_BEAT_SCHEDULE["roll-up-usage"]
    assert entry == {
        "task": "monitoring.tasks.roll_up_usage",
        "schedule": conf.SWITCHYARD_USAGE_ROLLUP_INTERVAL_S,
    }
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    sample(version, requests=2, rows=2, at=timezone.now())
    assert tasks.roll_up_usage() == {"changed": 1, "budgets_stopped": 0}
    assert UsageDay.objects.get().requests == 2
