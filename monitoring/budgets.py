"""Monthly budgets: what a tenant spent this UTC month (its ``UsageDay`` costs), alerts at its
thresholds (once per threshold per month, through ``monitoring.alerts``), and with a hard
stop, new work refused past 100 % until an approver's override ends.

The gateways read ``stopped_tenants`` every few seconds and refuse a stopped tenant's
requests from that cached set (no query per request).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from platform_site.errors import Forbidden, Invalid, OverBudget
from tenants.audit import SYSTEM, Actor, audit
from tenants.models import Role

from .alerts import raise_alert
from .models import AlertKind, Budget, UsageDay

MAX_LIMIT = Decimal("1000000000000")
MAX_THRESHOLDS = 10


def utc_today() -> date:
    return timezone.now().astimezone(UTC).date()


def month_of(day: date) -> date:
    return day.replace(day=1)


def next_month(month: date) -> date:
    return (month + timedelta(days=32)).replace(day=1)


def month_end(now: datetime) -> datetime:
    """The end of ``now``'s UTC month: an override lasts at most until then."""
    month = month_of(now.astimezone(UTC).date())
    return datetime.combine(next_month(month), time.min, tzinfo=UTC)


def _require_approver(actor: Actor, what: str) -> None:
    if actor.role != Role.APPROVER:
        raise Forbidden(f"only an approver can {what}")


def budget_of(tenant_id: int) -> Budget | None:
    return Budget.objects.filter(tenant_id=tenant_id).first()


def spent_in(tenant_id: int, month: date) -> Decimal:
    total = UsageDay.objects.filter(
        tenant_id=tenant_id, day__gte=month, day__lt=next_month(month)
    ).aggregate(cost=Sum("cost"))["cost"]
    # SQLite sums decimals with more places than the column has.
    return Decimal(total or 0).quantize(Decimal("0.000001"))


def refusal(budget: Budget) -> str:
    """What a refused request is told: the budget, what was spent, and the way out."""
    return (
        f"monthly budget of {budget.monthly_limit:.2f} {budget.currency} spent "
        f"({budget.spent:.2f} {budget.currency}); an approver can override"
    )


def check_budget(tenant_id: int) -> None:
    """Refuse new work (a batch job, say) of a tenant whose hard stop is in force: the same
    rule the gateways apply from their cached set, read from the database here."""
    budget = budget_of(tenant_id)
    if budget is not None and budget.stopped and not overridden(budget, timezone.now()):
        raise OverBudget(refusal(budget))


def overridden(budget: Budget, now: datetime) -> bool:
    return budget.override_until is not None and budget.override_until > now


# Setting a budget --------------------------------------------------------------------------------


def clean_budget(values: Any) -> dict[str, Any]:
    """The budget's fields from a caller; 400 naming the field for anything wrong."""
    if not isinstance(values, Mapping):
        raise Invalid("body", "an object with monthly_limit, thresholds and hard_stop")
    unknown = set(values) - {"monthly_limit", "thresholds", "hard_stop", "currency"}
    if unknown:
        raise Invalid(str(sorted(map(str, unknown))[0])[:40], "unknown field")
    raw = values.get("monthly_limit")
    if raw is None or isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise Invalid("monthly_limit", "a number is required")
    try:
        limit = Decimal(str(raw))
    except InvalidOperation:
        raise Invalid("monthly_limit", "a number is required") from None
    if not limit.is_finite() or limit <= 0:
        raise Invalid("monthly_limit", "must be a positive number")
    if limit > MAX_LIMIT:
        raise Invalid("monthly_limit", f"at most {MAX_LIMIT}")
    thresholds = values.get("thresholds", [50, 80, 100])
    if not isinstance(thresholds, list) or len(thresholds) > MAX_THRESHOLDS:
        raise Invalid("thresholds", f"a list of at most {MAX_THRESHOLDS} percents")
    for t in thresholds:
        if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= 1000:
            raise Invalid("thresholds", "each threshold is a whole percent from 1 to 1000")
    hard_stop = values.get("hard_stop", False)
    if not isinstance(hard_stop, bool):
        raise Invalid("hard_stop", "true or false")
    currency = values.get("currency", "USD")
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha():
        raise Invalid("currency", "a three-letter currency code")
    return {
        "monthly_limit": limit.quantize(Decimal("0.01")),
        "thresholds": sorted(set(thresholds)),
        "hard_stop": hard_stop,
        "currency": currency.upper(),
    }


def snapshot(budget: Budget | None) -> dict[str, Any]:
    if budget is None:
        return {}
    return {
        "monthly_limit": str(budget.monthly_limit),
        "currency": budget.currency,
        "thresholds": budget.thresholds,
        "hard_stop": budget.hard_stop,
        "stopped": budget.stopped,
        "override_until": budget.override_until.isoformat() if budget.override_until else None,
    }


def set_budget(tenant_id: int, values: Any, actor: Actor) -> Budget:
    """Set the tenant's monthly budget (approvers), evaluated at once against this month's
    spend so a raised limit lifts a stop without waiting for the roll-up. Audited."""
    _require_approver(actor, "set the budget")
    clean = clean_budget(values)
    with transaction.atomic():
        # Locked: the roll-up may be evaluating this budget at the same moment.
        budget = Budget.objects.select_for_update().filter(tenant_id=tenant_id).first()
        before = snapshot(budget)
        if budget is None:
            budget = Budget(tenant_id=tenant_id, **clean)
        else:
            for field, value in clean.items():
                setattr(budget, field, value)
        _evaluate(budget, utc_today(), timezone.now(), actor)
        audit(tenant_id, actor, "budget.set", "monthly budget", before, snapshot(budget))
    return budget


def override(tenant_id: int, actor: Actor, reason: Any, until: Any) -> Budget:
    """An approver lifts the hard stop until ``until`` (at most the month's end). Audited."""
    _require_approver(actor, "override the budget")
    if not isinstance(reason, str) or not reason.strip():
        raise Invalid("reason", "say why the budget is overridden")
    if len(reason) > 500:
        raise Invalid("reason", "at most 500 characters")
    now = timezone.now()
    if isinstance(until, datetime):
        end = until
    else:
        try:
            end = datetime.fromisoformat(str(until)[:64])
        except ValueError:
            raise Invalid(
                "until", "a date and time, ISO 8601 (e.g. 2026-11-30T18:00:00Z)"
            ) from None
    if end.tzinfo is None:
        raise Invalid("until", "needs a time zone (e.g. Z)")
    if end <= now:
        raise Invalid("until", "must be in the future")
    if end > month_end(now):
        raise Invalid("until", f"at most the month's end, {month_end(now).isoformat()}")
    with transaction.atomic():
        budget = Budget.objects.select_for_update().filter(tenant_id=tenant_id).first()
        if budget is None:
            raise Invalid("budget", "the tenant has no budget to override")
        before = snapshot(budget)
        budget.override_until, budget.override_by_id = end, actor.user_id
        budget.stopped = False
        budget.updated_at = now
        budget.save()
        audit(
            tenant_id, actor, "budget.override", "monthly budget", before, snapshot(budget), reason
        )
    return budget


# Evaluation ------------------------------------------------------------------------------------


def _evaluate(budget: Budget, today: date, now: datetime, actor: Actor = SYSTEM) -> None:
    """Bring one budget up to date (locked by the caller): this month's spend, its threshold
    alerts, and whether new work is refused; saves it. A change of stop state is audited."""
    month = month_of(today)
    if budget.month != month:
        budget.month, budget.alerted = month, []
    budget.spent = spent_in(budget.tenant_id, month)
    percent = budget.spent * 100 / budget.monthly_limit
    for threshold in sorted(budget.thresholds):
        if percent >= threshold and threshold not in budget.alerted:
            raise_alert(
                budget.tenant_id,
                AlertKind.BUDGET,
                f"budget:{month:%Y-%m}:{threshold}",
                f"{threshold}% of the monthly budget spent",
                f"{budget.spent:.2f} of {budget.monthly_limit:.2f} {budget.currency} spent in "
                f"{month:%B %Y} ({percent:.1f}%)"
                + ("; new work is refused" if budget.hard_stop and percent >= 100 else ""),
                severity="critical" if threshold >= 100 else "warning",
                details={"threshold": threshold, "spent": str(budget.spent)},
            )
            budget.alerted = [*budget.alerted, threshold]
    stop = budget.hard_stop and percent >= 100 and not overridden(budget, now)
    if stop != budget.stopped and budget.pk is not None:
        audit(
            budget.tenant_id,
            actor,
            "budget.stop" if stop else "budget.resume",
            "monthly budget",
            {"stopped": budget.stopped},
            {"stopped": stop, "spent": str(budget.spent)},
        )
    budget.stopped = stop
    budget.updated_at = now
    budget.save()


def evaluate_budgets(today: date | None = None) -> dict[str, int]:
    """Every budget against this month's spend (the roll-up runs it after the usage)."""
    today = today or utc_today()
    now = timezone.now()
    stopped = 0
    for budget_id in Budget.objects.values_list("pk", flat=True):
        with transaction.atomic():
            budget = Budget.objects.select_for_update().filter(pk=budget_id).first()
            if budget is None:
                continue
            _evaluate(budget, today, now)
            stopped += budget.stopped
    return {"budgets_stopped": stopped}


def stopped_tenants() -> dict[int, str]:
    """Tenants whose new work is refused now, and what they are told (the gateways cache it)."""
    now = timezone.now()
    stopped = Budget.objects.filter(stopped=True).filter(
        Q(override_until__isnull=True) | Q(override_until__lte=now)
    )
    return {b.tenant_id: refusal(b) for b in stopped}


def budget_figures() -> list[tuple[str, str, float, float, bool]]:
    """Every tenant's budget as ``/metrics`` exports it (read at each scrape, one query):
    (tenant slug, currency, monthly limit, spent this month at the last roll-up, whether new
    work is refused now)."""
    now = timezone.now()
    rows = Budget.objects.order_by("tenant__slug").values_list(
        "tenant__slug", "currency", "monthly_limit", "spent", "stopped", "override_until"
    )
    return [
        (slug, currency, float(limit), float(spent), stopped and not (until and until > now))
        for slug, currency, limit, spent, stopped, until in rows
    ]
