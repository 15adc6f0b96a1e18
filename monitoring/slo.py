"""Service-level objectives per model, from its versions' ``TrafficSample`` rows: the SLIs over
the SLO window, the error budget left, burn rates, and multi-window burn-rate alerts.

Two SLIs per model:

- availability: the share of requests answered without a server error (``1 − errors/requests``),
  against ``Model.slo_availability``. A version's failure that the model's fallback ladder
  answered (a degraded answer) is not an availability failure: it is reported as its own
  share, ``degraded``, beside the two SLIs;
- latency: the share of requests answered within ``Model.slo_latency_ms``, against
  ``Model.slo_latency_target``. Latencies are only known as histogram buckets
  (``monitoring.traffic.LATENCY_BOUNDS_MS``, bucket i holding (bound[i-1], bound[i]]), so a request
  counts as fast only when its whole bucket lies at or under the threshold: a threshold between
  two bounds counts the bucket that straddles it as slow. The SLI is never overstated.

A burn rate is the bad share over a window divided by the share the objective allows
(``1 − objective``): at 1 the budget lasts exactly the SLO window. Alerts follow the Google SRE
workbook's multi-window rule: critical when the 1 h and 5 m burn rates both exceed 14.4 (2 % of
a 30-day budget in an hour), warning when the 6 h and 30 m rates both exceed 6 (5 % in six
hours); the short window makes the alert stop soon after the burning does.

Too few requests say nothing about a budget: an alert needs ``SWITCHYARD_SLO_MIN_EVENTS``
requests (default 100) in its long window, and a budget counts as spent (the release freeze)
only with that many in the SLO window. Below it the SLI shows "not enough data".
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import BigIntegerField, F, Q, Sum, Value
from django.db.models.expressions import Expression
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, TruncMinute
from django.utils import timezone

from registry.models import Model

from .alerts import raise_alert, resolve_alert
from .models import Alert, AlertKind, TrafficSample
from .traffic import LATENCY_BOUNDS_MS

SLIS = ("availability", "latency")
BURN_WINDOWS = {
    "5m": timedelta(minutes=5),
    "30m": timedelta(minutes=30),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
}
# (long window, short window, burn rate both must exceed, severity), most severe first.
ALERT_RULES = (("1h", "5m", 14.4, "critical"), ("6h", "30m", 6.0, "warning"))
CHART_HOURS = 6
CHART_STEP = timedelta(minutes=1)
CHART_WINDOWS = ("1h", "5m")  # the burn rates the chart draws, one per alert rule's pair


def slo_window() -> timedelta:
    return timedelta(days=settings.SWITCHYARD_SLO_WINDOW_DAYS)


@dataclass(frozen=True)
class WindowCounts:
    """Requests over some window: how many, how many failed, how many were fast enough."""

    requests: int = 0
    errors: int = 0  # not counting degraded answers
    fast: int = 0
    degraded: int = 0
    not_ready: int = 0  # refused before a replica was ready: in neither count above

    def bad(self, sli: str) -> int:
        return self.errors if sli == "availability" else self.requests - self.fast

    def bad_share(self, sli: str) -> float | None:
        """None without requests: an SLI of nothing is unknown, not perfect."""
        return self.bad(sli) / self.requests if self.requests else None


def objective_of(model: Model, sli: str) -> float:
    return model.slo_availability if sli == "availability" else model.slo_latency_target


def fast_buckets(threshold_ms: float) -> int:
    """How many leading histogram buckets lie wholly at or under the threshold."""
    return bisect.bisect_right(LATENCY_BOUNDS_MS, threshold_ms)


def bucket_count(index: int) -> Expression:
    """One histogram bucket of a ``TrafficSample`` row as an integer, in SQL (a JSON array
    element works on SQLite and PostgreSQL), so windows of days sum in the database."""
    return Coalesce(
        Cast(KeyTextTransform(str(index), "latency_buckets"), BigIntegerField()), Value(0)
    )


def fast_expression(threshold_ms: float) -> Expression:
    """The requests of a row answered within the threshold (the straddling bucket is slow)."""
    n = fast_buckets(threshold_ms)
    if n == 0:
        return Value(0, output_field=BigIntegerField())
    total = bucket_count(0)
    for i in range(1, n):
        total = total + bucket_count(i)
    return total


def burn_rate(tally: WindowCounts, sli: str, objective: float) -> float:
    """The bad share over the allowed share; 0 without requests (nothing was spent)."""
    share = tally.bad_share(sli)
    return 0.0 if share is None else share / (1.0 - objective)


def min_events() -> int:
    return int(settings.SWITCHYARD_SLO_MIN_EVENTS)


def alert_level(
    burn: dict[str, float], events: dict[str, int] | None = None
) -> tuple[str, str, float, str] | None:
    """The first multi-window rule whose both windows burn past its rate, its long window
    holding at least ``min_events()`` requests (``events``: requests per window), else None:
    ``(long window, short window, rate, severity)``."""
    for long, short, rate, severity in ALERT_RULES:
        if events is not None and events.get(long, 0) < min_events():
            continue
        if burn[long] > rate and burn[short] > rate:
            return long, short, rate, severity
    return None


def model_tallies(model: Model, now: datetime) -> dict[str, WindowCounts]:
    """The model's tallies over the SLO window ("slo") and every burn window, in one query."""
    windows = {"slo": slo_window(), **BURN_WINDOWS}
    fast = fast_expression(model.slo_latency_ms)
    sums = {}
    for name, span in windows.items():
        within = Q(window_end__gt=now - span)
        sums[f"{name}:requests"] = Sum("requests", filter=within)
        sums[f"{name}:errors"] = Sum(F("errors") - F("degraded"), filter=within)
        sums[f"{name}:fast"] = Sum(fast, filter=within)
        sums[f"{name}:degraded"] = Sum("degraded", filter=within)
        sums[f"{name}:not_ready"] = Sum("not_ready", filter=within)
    rows = TrafficSample.objects.filter(
        version__model_id=model.pk,
        window_end__gt=now - max(windows.values()),
        window_end__lte=now,
    )
    got = rows.aggregate(**sums)
    return {
        name: WindowCounts(
            got[f"{name}:requests"] or 0,
            got[f"{name}:errors"] or 0,
            got[f"{name}:fast"] or 0,
            got[f"{name}:degraded"] or 0,
            got[f"{name}:not_ready"] or 0,
        )
        for name in windows
    }


def sli_status(model: Model, sli: str, tallies: dict[str, WindowCounts]) -> dict[str, Any]:
    """One SLI of a model: objective, value over the SLO window, budget left, burn rates and
    the alert rule that holds now (if any)."""
    objective = objective_of(model, sli)
    window = tallies["slo"]
    share = window.bad_share(sli)
    burn = {name: round(burn_rate(tallies[name], sli, objective), 4) for name in BURN_WINDOWS}
    events = {name: tallies[name].requests for name in BURN_WINDOWS}
    level = alert_level(burn, events)
    return {
        "sli": sli,
        "objective": objective,
        "threshold_ms": model.slo_latency_ms if sli == "latency" else None,
        "requests": window.requests,
        # Fewer requests than this over the SLO window: the budget is "not enough data".
        "min_events": min_events(),
        "enough_data": window.requests >= min_events(),
        "events": events,
        "bad": window.bad(sli),
        "value": None if share is None else round(1.0 - share, 6),
        # Negative once the budget is overspent; 1 when nothing was spent (or nothing served).
        "budget_remaining": round(1.0 - burn_rate(window, sli, objective), 6),
        "burn": burn,
        "alert": None if level is None else level[3],
    }


def model_slos(model: Model, now: datetime | None = None) -> dict[str, Any]:
    """Both SLIs of a model, as the SLO page, its JSON and the alerting read them."""
    now = now or timezone.now()
    tallies = model_tallies(model, now)
    return {
        "model": model.name,
        "model_id": model.pk,
        "window_days": settings.SWITCHYARD_SLO_WINDOW_DAYS,
        "slis": [sli_status(model, sli, tallies) for sli in SLIS],
        # Answers the fallback ladder gave over the SLO window (their own SLI, no objective).
        "degraded": tallies["slo"].degraded,
        "degraded_share": (
            round(tallies["slo"].degraded / tallies["slo"].requests, 6)
            if tallies["slo"].requests
            else None
        ),
        # Requests refused (503, Retry-After) while no replica was ready yet: not in the SLIs.
        "not_ready": tallies["slo"].not_ready,
    }


def error_budget_spent(model: Model, now: datetime | None = None) -> list[str]:
    """Each SLI of the model whose error budget over the SLO window is spent, in words ("the
    availability SLO (99.9 % of requests without a server error): 30-day error budget spent,
    150 % over"); empty when every budget has some left. What the release freeze reads."""
    status = model_slos(model, now)
    spent = []
    for sli in status["slis"]:
        if sli["enough_data"] and sli["budget_remaining"] <= 0:
            objective = f"{sli['objective'] * 100:g} %"
            what = (
                f"{objective} of requests without a server error"
                if sli["sli"] == "availability"
                else f"{objective} of requests within {sli['threshold_ms']:g} ms"
            )
            spent.append(
                f"the {sli['sli']} SLO ({what}): {status['window_days']:g}-day error budget "
                f"spent, {-sli['budget_remaining'] * 100:.0f} % over"
            )
    return spent


def burn_series(
    model: Model, now: datetime | None = None, hours: int = CHART_HOURS
) -> dict[str, Any]:
    """The 1 h and 5 m burn rates of both SLIs at every minute of the last ``hours``, for the
    chart: ``{"t": [...], "availability_1h": [...], ...}``; None where a window saw no requests."""
    now = now or timezone.now()
    step = CHART_STEP
    end = now.replace(second=0, microsecond=0)  # the current minute, still filling
    longest = max(BURN_WINDOWS[w] for w in CHART_WINDOWS)
    first = end - timedelta(hours=hours)
    minutes = (
        TrafficSample.objects.filter(
            version__model_id=model.pk, window_end__gte=first - longest, window_end__lte=now
        )
        .annotate(minute=TruncMinute("window_end"))
        .values("minute")
        .annotate(
            requests=Sum("requests"),
            errors=Sum(F("errors") - F("degraded")),
            fast=Sum(fast_expression(model.slo_latency_ms)),
        )
    )
    per_minute = {
        row["minute"]: WindowCounts(row["requests"], row["errors"], row["fast"] or 0)
        for row in minutes
    }
    series: dict[str, list[Any]] = {"t": []}
    for sli in SLIS:
        for window in CHART_WINDOWS:
            series[f"{sli}_{window}"] = []
    at = first
    while at <= end:
        series["t"].append((at + step).isoformat())  # a minute's point sits at its end
        for window in CHART_WINDOWS:
            span = int(BURN_WINDOWS[window] / step)
            tally = _sum(per_minute.get(at - i * step) for i in range(span))
            for sli in SLIS:
                rate = burn_rate(tally, sli, objective_of(model, sli))
                series[f"{sli}_{window}"].append(round(rate, 4) if tally.requests else None)
        at += step
    return series


def _sum(tallies: Iterable[WindowCounts | None]) -> WindowCounts:
    requests = errors = fast = 0
    for t in tallies:
        if t is not None:
            requests, errors, fast = requests + t.requests, errors + t.errors, fast + t.fast
    return WindowCounts(requests, errors, fast)


# Alerting ------------------------------------------------------------------------------------


def alert_key(model_id: int, sli: str) -> str:
    return f"slo:{model_id}:{sli}"


def evaluate_model(model: Model, now: datetime | None = None) -> dict[str, str | None]:
    """Raise or resolve the model's SLO burn alerts; returns {sli: severity or None}."""
    status = model_slos(model, now)
    done: dict[str, str | None] = {}
    for sli in status["slis"]:
        key = alert_key(model.pk, sli["sli"])
        level = alert_level(sli["burn"], sli["events"])
        if level is None:
            resolve_alert(model.tenant_id, key)
            done[sli["sli"]] = None
            continue
        long, short, rate, severity = level
        # An open warning that turns critical is closed and raised anew, so the escalation
        # posts to the webhook (a refresh of an open alert does not post).
        if severity == "critical":
            Alert.objects.filter(
                tenant_id=model.tenant_id, key=key, resolved_at=None, severity="warning"
            ).update(resolved_at=timezone.now())
        raise_alert(
            model.tenant_id,
            AlertKind.SLO_BURN,
            key,
            f"{model.name}: {sli['sli']} SLO error budget burning fast",
            burn_message(sli, long, short, rate, status["window_days"]),
            model_id=model.pk,
            severity=severity,
            details={
                "sli": sli["sli"],
                "objective": sli["objective"],
                "threshold_ms": sli["threshold_ms"],
                "burn": sli["burn"],
                "budget_remaining": sli["budget_remaining"],
                "rule": {"long": long, "short": short, "rate": rate},
            },
        )
        done[sli["sli"]] = severity
    return done


def burn_message(
    sli: dict[str, Any], long: str, short: str, rate: float, window_days: float
) -> str:
    burn = sli["burn"][long]
    objective = f"{sli['objective'] * 100:g} %"
    what = (
        f"{objective} of requests without a server error"
        if sli["sli"] == "availability"
        else f"{objective} of requests within {sli['threshold_ms']:g} ms"
    )
    left = sli["budget_remaining"]
    if left <= 0:
        budget = f"The {window_days:g}-day error budget is spent ({-left * 100:.0f} % over)."
    else:
        # The budget left, spent at the long window's rate (a burn of 1 spends all of it in
        # the SLO window).
        hours = left * window_days * 24 / burn
        budget = f"{left * 100:.1f} % of the {window_days:g}-day error budget is left: gone in "
        budget += f"{hours:.1f} hours at this rate."
    return (
        f"Burn rate {burn:.1f}x over {long} and {sli['burn'][short]:.1f}x over {short} "
        f"(alert above {rate:g}x) against the objective of {what}. {budget}"
    )


def evaluate_slos(now: datetime | None = None) -> dict[int, dict[str, str | None]]:
    """Every model that served in the last 6 h, or has an SLO alert open: raise or resolve its
    alerts. Returns {model id: {sli: severity or None}}."""
    now = now or timezone.now()
    since = now - max(BURN_WINDOWS.values())
    served = TrafficSample.objects.filter(window_end__gt=since).values("version__model_id")
    alerted = Alert.objects.filter(kind=AlertKind.SLO_BURN, resolved_at=None, model__isnull=False)
    models = Model.objects.filter(
        Q(pk__in=served) | Q(pk__in=alerted.values("model_id"))
    ).distinct()
    return {model.pk: evaluate_model(model, now) for model in models}
