"""The usage page (``/usage/``, ``web.usage_views``): costs with their currency or "unpriced",
when the numbers were rolled up, "no data yet" in place of empty charts, and an approver's
prices and budget forms, which send what ``static/ui/usage.js`` sends to the same audited API
(other roles see the values read-only; another tenant's data never shows)."""

from __future__ import annotations

import re
from datetime import UTC
from decimal import Decimal
from html import unescape

import pytest
from django.test import Client
from django.utils import timezone

from monitoring import budgets, usage
from monitoring.models import Budget, Price, Resource, TrafficSample, UsageDay
from tenants.audit import Actor
from tenants.models import AuditEvent
from tests.factories import as_user, make_member, make_model, make_version


def today():
    return timezone.now().astimezone(UTC).date()


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def page(user) -> str:
    response = signed_in(user).get("/usage/")
    assert response.status_code == 200
    return response.content.decode()


def cells(html: str, table: str) -> list[str]:
    """The text of the last cell (the cost) of each row of a table on the page."""
    body = html.split(f'id="{table}"')[1].split("</table>")[0]
    return [
        unescape(re.sub(r"<[^>]+>", "", row.rsplit("<td", 1)[1].split(">", 1)[1])).strip()
        for row in body.split("<tbody>")[1].split("</tr>")[:-1]
    ]


@pytest.fixture
def boss(world):
    return make_member(world.a, "appr-alpha", "approver")


@pytest.fixture
def clf(world, onnx_bytes):
    return make_version(make_model(world.a, "clf"), onnx_bytes)


def served(version, **units) -> UsageDay:
    return UsageDay.objects.create(
        tenant=version.model.tenant, model=version.model, version=version, day=today(), **units
    )


def sample(version, requests: int) -> None:
    """What the gateway stores as it counts; the roll-up prices it."""
    TrafficSample.objects.create(
        version=version,
        window_end=timezone.now(),
        requests=requests,
        errors=0,
        latency_buckets=[0] * 15,
    )


# How costs read ---------------------------------------------------------------------------------


@pytest.mark.django_db
def test_usage_without_any_price_shows_unpriced_not_zero_with_a_hint(world, clf, boss):
    served(clf, requests=10, rows=10)
    html = page(world.viewer_a)
    assert cells(html, "by-version") == ["unpriced"]
    assert cells(html, "by-day") == ["unpriced"]
    assert "data-unpriced-hint" in html
    assert 'href="#prices"' in html and "an approver sets one" in html
    assert "set one under" in page(boss)  # the approver is sent to the form itself
    assert 'data-pricing="unpriced"' in html  # the cost chart says so too


@pytest.mark.django_db
def test_costs_show_two_decimals_and_their_currency_unit_prices_more(world, clf, boss, onnx_bytes):
    usage.set_prices(world.a.pk, {"request": "0.0125"}, Actor(boss.pk, "boss", "approver"))
    served(clf, requests=992, cost=Decimal("12.4"))
    other = make_version(make_model(world.a, "tiny"), onnx_bytes, alias=None)
    served(other, requests=1, cost=Decimal("0.000123"))
    html = page(world.viewer_a)
    assert cells(html, "by-version") == ["12.40 USD", "< 0.01 USD"]
    assert "12.40 USD" in html.split("data-total-cost")[1].split("</b>")[0]
    assert "0.0125 USD" in html.split('id="prices-table"')[1]  # a unit price keeps its places
    assert "data-unpriced-hint" not in html


@pytest.mark.django_db
def test_usage_with_some_resources_unpriced_says_which(world, clf, boss):
    usage.set_prices(world.a.pk, {"request": "0.01"}, Actor(boss.pk, "boss", "approver"))
    served(clf, requests=100, tokens_in=500, cost=1)
    (cost,) = cells(page(world.viewer_a), "by-version")
    assert cost.startswith("1.00 USD") and "unpriced tokens in" in cost


@pytest.mark.django_db
def test_a_platform_default_prices_a_tenants_usage(world, clf):
    usage.set_prices(None, {"request": "2"}, Actor(None, "operator"))
    served(clf, requests=3, cost=6)
    html = page(world.viewer_a)
    assert cells(html, "by-version") == ["6.00 USD"]
    assert "2.00 USD" in html.split('data-resource="request"')[1].split("</tr>")[0]


# Freshness and empty states ----------------------------------------------------------------------


@pytest.mark.django_db
def test_the_page_says_when_the_usage_was_rolled_up(world, clf):
    assert "not rolled up yet" in page(world.viewer_a)
    sample(clf, 5)
    usage.roll_up()
    stamp = UsageDay.objects.get().updated_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M")
    assert f"rolled up at {stamp} UTC" in page(world.viewer_a)


@pytest.mark.django_db
def test_an_empty_window_says_no_data_yet_instead_of_drawing_empty_axes(world):
    html = page(world.viewer_a)
    assert 'id="cost-chart"' not in html and 'id="units-chart"' not in html
    assert 'data-no-data="cost-chart"' in html and 'data-no-data="units-chart"' in html
    assert cells(html, "by-version") == cells(html, "by-day") == ["No data yet in this window."]


# Setting prices and the budget -------------------------------------------------------------------


@pytest.mark.django_db
def test_an_approver_sets_a_price_on_the_page_audited_and_the_page_shows_it(world, clf, boss):
    sample(clf, 10)
    usage.roll_up()
    html = page(boss)
    assert "data-prices-form" in html and "data-prices-msg" in html
    for resource in Resource:  # one input per resource the API takes, named as it names them
        assert f'data-price="{resource.value}"' in html
    assert cells(html, "by-version") == ["unpriced"]
    # What usage.js sends for the one price changed.
    response = as_user(boss).put("/api/v1/usage/prices", {"prices": {"request": "0.25"}})
    assert response.status_code == 200
    event = AuditEvent.objects.get(action="usage.prices")
    assert event.tenant_id == world.a.pk and event.actor_id == boss.pk
    assert event.after == {"request": "0.250000000"}
    usage.roll_up()  # the beat task prices today's usage with the new price
    html = page(boss)
    assert cells(html, "by-version") == ["2.50 USD"]
    assert 'data-initial="0.25" value="0.25"' in html  # the form starts from what is set
    # An emptied input is sent as null: the tenant's own price goes, the default applies again.
    as_user(boss).put("/api/v1/usage/prices", {"prices": {"request": None}})
    assert usage.prices_of(world.a.pk) == {}
    assert AuditEvent.objects.filter(action="usage.prices").count() == 2


@pytest.mark.django_db
def test_an_approver_sets_the_monthly_budget_on_the_page_audited_and_shown(world, boss):
    html = page(boss)
    assert "data-budget-form" in html and "data-no-budget" in html
    for field in ("monthly_limit", "currency", "thresholds", "hard_stop"):  # the API's fields
        assert f'name="{field}"' in html
    body = {"monthly_limit": "250", "currency": "usd", "thresholds": [50, 90], "hard_stop": True}
    response = as_user(boss).put("/api/v1/budget", body)
    assert response.status_code == 200
    event = AuditEvent.objects.get(action="budget.set")
    assert event.tenant_id == world.a.pk and event.after["monthly_limit"] == "250.00"
    html = page(boss)
    assert "0.00 USD of 250.00 USD spent this month" in html
    assert 'value="50, 90"' in html and 'name="hard_stop" checked' in html
    assert "data-no-budget" not in html


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["viewer", "engineer"])
def test_other_roles_see_prices_and_budget_read_only_and_cannot_set_them(world, role):
    usage.set_prices(world.a.pk, {"row": "0.5"}, Actor(None, "boss", "approver"))
    budgets.set_budget(world.a.pk, {"monthly_limit": 100}, Actor(None, "boss", "approver"))
    member = world.viewer_a if role == "viewer" else world.engineer_a
    html = page(member)
    assert "data-prices-form" not in html and "data-budget-form" not in html
    assert "data-price=" not in html and "data-prices-readonly" in html
    assert "0.50 USD" in html and "of 100.00 USD spent" in html
    client = as_user(member)
    assert client.put("/api/v1/usage/prices", {"prices": {"row": "9"}}).status_code == 403
    assert client.put("/api/v1/budget", {"monthly_limit": "1"}).status_code == 403
    assert usage.prices_of(world.a.pk) == {"row": Decimal("0.5")}
    assert Budget.objects.get().monthly_limit == 100
    assert not AuditEvent.objects.filter(actor_id=member.pk)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "url, body, field",
    [
        ("/api/v1/usage/prices", {"prices": {"row": "abc"}}, "prices.row"),
        ("/api/v1/usage/prices", {"prices": {"row": "-1"}}, "prices.row"),
        ("/api/v1/usage/prices", {"prices": {"request": "1e30"}}, "prices.request"),
        ("/api/v1/budget", {"monthly_limit": "", "currency": "USD"}, "monthly_limit"),
        ("/api/v1/budget", {"monthly_limit": "-5", "currency": "USD"}, "monthly_limit"),
        ("/api/v1/budget", {"monthly_limit": "10", "currency": "dollars"}, "currency"),
        ("/api/v1/budget", {"monthly_limit": "10", "thresholds": [50, "lots"]}, "thresholds"),
    ],
)
def test_bad_input_from_the_forms_is_400_naming_the_field_and_changes_nothing(
    world, boss, url, body, field
):
    response = as_user(boss).put(url, body)
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"{field}:")  # what the form shows beside it
    assert not Price.objects.exists() and not Budget.objects.exists()
    assert not AuditEvent.objects.filter(action__in=["usage.prices", "budget.set"])


# Tenant isolation ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_another_tenants_usage_prices_and_budget_never_show(world, clf, boss, onnx_bytes):
    theirs = make_version(make_model(world.b, "secret-model"), onnx_bytes)
    served(theirs, requests=987654, cost=Decimal("4321.98"))
    boss_b = make_member(world.b, "appr-beta", "approver")
    usage.set_prices(world.b.pk, {"row": "0.424242"}, Actor(boss_b.pk, "b", "approver"))
    budgets.set_budget(world.b.pk, {"monthly_limit": 8765432}, Actor(boss_b.pk, "b", "approver"))
    served(clf, requests=1)
    html = page(boss)
    for secret in ("secret-model", "987654", "4321", "424242", "8765432"):
        assert secret not in html
    # Alpha's approver cannot set beta's prices or budget by naming beta.
    refused = as_user(boss, "beta").put("/api/v1/usage/prices", {"prices": {"row": "0"}})
    assert refused.status_code == 403
    assert as_user(boss, "beta").put("/api/v1/budget", {"monthly_limit": 1}).status_code == 403
    assert usage.prices_of(world.b.pk) == {"row": Decimal("0.424242")}
    assert Budget.objects.get(tenant=world.b).monthly_limit == 8765432


@pytest.mark.django_db
def test_operators_see_each_tenants_rows_priced_by_that_tenants_prices(
    world, clf, boss, admin_user, onnx_bytes
):
    from tenants.models import Membership

    usage.set_prices(world.a.pk, {"request": "1"}, Actor(boss.pk, "boss", "approver"))
    served(clf, requests=4, cost=4)
    served(make_version(make_model(world.b, "other"), onnx_bytes), requests=9)
    Membership.objects.create(tenant=world.a, user=admin_user, role="viewer")
    html = signed_in(admin_user).get("/usage/?all=1").content.decode()
    assert cells(html, "by-version") == ["4.00 USD", "unpriced"]  # alpha's, then beta's
