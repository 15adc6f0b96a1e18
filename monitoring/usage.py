"""Usage metering and chargeback: what each version served per UTC day (requests, rows, tokens
from the gateways' traffic samples; CPU- and accelerator-seconds from the agents' heartbeats),
priced by the tenant's prices, else the platform's defaults, else nothing.

Sources and roll-up: the gateways count requests, rows and tokens in process and store them
with their ``TrafficSample`` rows; each stored heartbeat adds its versions' compute since the
session's previous heartbeat to ``ComputeDay`` (``record_compute``). The beat task
(``roll_up``) recomputes today's and yesterday's ``UsageDay`` rows from those sources, so
running it twice changes nothing, and then evaluates the budgets.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction
from django.db.models import F, Max, QuerySet, Sum
from django.utils import timezone

from platform_site.errors import Forbidden, Invalid
from registry.models import ModelVersion
from tenants.audit import Actor, audit
from tenants.models import Role

from .budgets import evaluate_budgets, utc_today
from .models import ComputeDay, Price, Resource, TrafficSample, UsageDay

RESOURCES = [r.value for r in Resource]
# A UsageDay field per resource: what one unit of each price is multiplied by.
UNITS_FIELD = {
    Resource.REQUEST: "requests",
    Resource.ROW: "rows",
    Resource.TOKEN_IN: "tokens_in",
    Resource.TOKEN_OUT: "tokens_out",
    Resource.CPU_SECOND: "cpu_s",
    Resource.ACCEL_SECOND: "accel_s",
}
# What an agent may claim for one version in one heartbeat: more than a day of compute between
# two heartbeats is no measurement (agents are untrusted; see record_compute).
MAX_DELTA_S = 86_400.0
MAX_PRICE = Decimal("1000000")
CENT = Decimal("0.000001")


# Compute from heartbeats ----------------------------------------------------------------------


def _seconds(load: Mapping[str, Any], field: str) -> float:
    value = load.get(field, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    if not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)


def compute_deltas(
    previous: Mapping[str, Any], current: Mapping[str, Any]
) -> dict[int, tuple[float, float]]:
    """Per version, the (CPU, accelerator) seconds between two heartbeats of one session.

    The agent's totals count since the version loaded on it. A session's first heartbeat only
    sets the baseline (``previous`` empty): an agent that reconnects keeps its totals, and
    counting them again on its new session would charge them twice. A version new since the
    previous heartbeat, or whose totals went down (it was unloaded and loaded again), counts
    its totals in full. Negative, non-finite and implausible claims count nothing.
    """
    if not previous:
        return {}
    before = {v["version_id"]: v for v in previous.get("versions", []) if isinstance(v, Mapping)}
    deltas: dict[int, tuple[float, float]] = {}
    for load in current.get("versions", []):
        version_id = load.get("version_id")
        if not isinstance(version_id, int):
            continue
        old = before.get(version_id, {})
        pair = []
        for field in ("cpu_s_total", "accel_s_total"):
            now, then = _seconds(load, field), _seconds(old, field)
            delta = now - then if now >= then else now
            pair.append(delta if delta <= MAX_DELTA_S else 0.0)
        if pair[0] > 0 or pair[1] > 0:
            deltas[version_id] = (pair[0], pair[1])
    return deltas


def record_compute(
    previous: Mapping[str, Any], current: Mapping[str, Any], when: datetime | None = None
) -> None:
    """Add a heartbeat's compute deltas to its versions' ``ComputeDay`` rows (called where the
    platform stores a heartbeat, in its transaction)."""
    deltas = compute_deltas(previous, current)
    if not deltas:
        return
    day = (when or timezone.now()).astimezone(UTC).date()
    known = set(ModelVersion.objects.filter(pk__in=deltas).values_list("pk", flat=True))
    for version_id, (cpu_s, accel_s) in deltas.items():
        if version_id not in known:
            continue
        ComputeDay.objects.get_or_create(version_id=version_id, day=day)
        # An increment in SQL: two gateway processes may store heartbeats at the same time.
        ComputeDay.objects.filter(version_id=version_id, day=day).update(
            cpu_s=F("cpu_s") + cpu_s, accel_s=F("accel_s") + accel_s
        )


# Prices ----------------------------------------------------------------------------------------


def price_rows(tenant_id: int | None) -> QuerySet[Price]:
    """The tenant's own price rows (``None``: the platform's defaults)."""
    if tenant_id is None:
        return Price.objects.filter(tenant__isnull=True)
    return Price.objects.filter(tenant_id=tenant_id)


def prices_of(tenant_id: int | None) -> dict[str, Decimal]:
    """The tenant's own prices (``None``: the platform's defaults), by resource."""
    return {p.resource: p.unit_price for p in price_rows(tenant_id) if p.resource in UNITS_FIELD}


def effective_prices(tenant_id: int) -> dict[str, Decimal]:
    """What each unit costs the tenant: its price, else the default, else 0."""
    defaults = prices_of(None)
    own = prices_of(tenant_id)
    return {r: own.get(r, defaults.get(r, Decimal(0))) for r in RESOURCES}


def clean_prices(values: Any) -> dict[str, Decimal]:
    """``{resource: unit price}`` from a caller; 400 naming the resource for an unknown one or
    a price that is negative, not a number or too large."""
    if not isinstance(values, Mapping):
        raise Invalid("prices", "an object of {resource: unit price}")
    clean: dict[str, Decimal] = {}
    for resource, value in values.items():
        field = f"prices.{str(resource)[:40]}"
        if resource not in UNITS_FIELD:
            raise Invalid(field, f"unknown resource; one of {', '.join(RESOURCES)}")
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise Invalid(field, "a unit price is a number")
        try:
            price = Decimal(str(value))
        except InvalidOperation:
            raise Invalid(field, "a unit price is a number") from None
        if not price.is_finite():
            raise Invalid(field, "a unit price is a finite number")
        if price < 0:
            raise Invalid(field, "a unit price cannot be negative")
        if price > MAX_PRICE:
            raise Invalid(field, f"at most {MAX_PRICE} per unit")
        clean[resource] = price.quantize(Decimal("0.000000001"))
    return clean


def set_prices(tenant_id: int | None, values: Any, actor: Actor) -> dict[str, Decimal]:
    """Set some of the tenant's prices (approvers; ``tenant_id`` None: the platform's
    defaults, which the caller has checked is an operator); a resource given as ``null`` is
    removed (the default applies again). Audited; returns the prices now set."""
    if tenant_id is not None and actor.role != Role.APPROVER:
        raise Forbidden("only an approver can set the tenant's prices")
    if isinstance(values, Mapping):
        removed = [r for r, v in values.items() if v is None]
        values = {r: v for r, v in values.items() if v is not None}
    else:
        removed = []
    clean = clean_prices(values)
    for resource in removed:
        if resource not in UNITS_FIELD:
            raise Invalid(f"prices.{str(resource)[:40]}", "unknown resource")
    with transaction.atomic():
        before = {r: str(p) for r, p in prices_of(tenant_id).items()}
        price_rows(tenant_id).filter(resource__in=removed).delete()
        for resource, price in clean.items():
            Price.objects.update_or_create(
                tenant_id=tenant_id,
                resource=resource,
                defaults={
                    "unit_price": price,
                    "set_by_id": actor.user_id,
                    "set_at": timezone.now(),
                },
            )
        after = {r: str(p) for r, p in prices_of(tenant_id).items()}
        audit(
            tenant_id,
            actor,
            "usage.prices" if tenant_id is not None else "usage.default_prices",
            "tenant prices" if tenant_id is not None else "platform default prices",
            before,
            after,
        )
    return prices_of(tenant_id)


# What a price is in when nobody said otherwise (``Price.currency``'s default).
DEFAULT_CURRENCY = "USD"


@dataclass(frozen=True)
class Pricing:
    """How a tenant's costs read: the currency its prices are in, and the resources nobody
    priced (neither the tenant nor the platform's defaults). What those count costs 0
    because it is unpriced, not because it is free: a page says so rather than show 0."""

    currency: str
    unpriced: frozenset[str]

    def missing(self, item: Mapping[str, Any]) -> list[str]:
        """The resources that an item (a ``grouped`` row or the ``totals``) counted and that
        have no price."""
        return [r for r, f in UNITS_FIELD.items() if item.get(f) and r in self.unpriced]

    def state(self, item: Mapping[str, Any]) -> str:
        """``unpriced`` when nothing the item counted has a price, ``partly`` when some of it
        has none, else ``priced`` (an item that counted nothing is priced: it cost nothing)."""
        used = [r for r, f in UNITS_FIELD.items() if item.get(f)]
        missing = self.missing(item)
        if not missing:
            return "priced"
        return "unpriced" if len(missing) == len(used) else "partly"

    @staticmethod
    def together(pricings: Iterable[Pricing]) -> Pricing:
        """Several tenants' at once (the operators' totals): what any of them has unpriced,
        and their currency, or none that a sum over them could be in."""
        pricings = list(pricings)
        currencies = {p.currency for p in pricings} or {DEFAULT_CURRENCY}
        currency = currencies.pop() if len(currencies) == 1 else "(mixed currencies)"
        return Pricing(currency, frozenset(r for p in pricings for r in p.unpriced))


def pricing_of(tenant_id: int) -> Pricing:
    """The tenant's ``Pricing``: its own prices' currency, else the defaults', else USD."""
    rows = list(price_rows(tenant_id)) + list(price_rows(None))
    priced = {p.resource for p in rows}
    currency = rows[0].currency if rows else DEFAULT_CURRENCY
    return Pricing(currency, frozenset(r for r in RESOURCES if r not in priced))


def pricing_by_tenant(rows: QuerySet[UsageDay]) -> dict[str, Pricing]:
    """``pricing_of`` each tenant among the rows, by slug (the operators' every-tenant view)."""
    tenants = dict(rows.order_by().values_list("tenant__slug", "tenant_id").distinct())
    return {slug: pricing_of(tenant_id) for slug, tenant_id in tenants.items()}


def cost_of(units: Mapping[str, float | int], prices: Mapping[str, Decimal]) -> Decimal:
    """Sum over resources of units x unit price, to the micro-unit."""
    total = Decimal(0)
    for resource, field in UNITS_FIELD.items():
        amount = units.get(field, 0) or 0
        if amount:
            total += Decimal(repr(float(amount))) * prices.get(resource, Decimal(0))
    return total.quantize(CENT)


# Roll-up ---------------------------------------------------------------------------------------


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time.min, tzinfo=UTC)
    return start, start + timedelta(days=1)


def roll_up_day(day: date) -> int:
    """Recompute one day's ``UsageDay`` rows from the sources; returns how many rows changed
    (0 when nothing did: running it again is a no-op)."""
    start, end = day_bounds(day)
    units: dict[int, dict[str, float | int]] = {}
    traffic = (
        TrafficSample.objects.filter(window_end__gte=start, window_end__lt=end)
        .values("version_id")
        .annotate(
            requests=Sum("requests"),
            errors=Sum("errors"),
            rows=Sum("rows"),
            tokens_in=Sum("tokens_in"),
            tokens_out=Sum("tokens_out"),
        )
    )
    for row in traffic:
        units[row["version_id"]] = {
            # Requests answered: a server error (5xx) is not charged.
            "requests": (row["requests"] or 0) - (row["errors"] or 0),
            "rows": row["rows"] or 0,
            "tokens_in": row["tokens_in"] or 0,
            "tokens_out": row["tokens_out"] or 0,
        }
    for version_id, cpu_s, accel_s in ComputeDay.objects.filter(day=day).values_list(
        "version_id", "cpu_s", "accel_s"
    ):
        entry = units.setdefault(version_id, {})
        entry["cpu_s"], entry["accel_s"] = round(cpu_s, 6), round(accel_s, 6)
    owners = {
        vid: (model_id, tenant_id)
        for vid, model_id, tenant_id in ModelVersion.objects.filter(pk__in=units).values_list(
            "pk", "model_id", "model__tenant_id"
        )
    }
    prices: dict[int, dict[str, Decimal]] = {}
    existing = {u.version_id: u for u in UsageDay.objects.filter(day=day, version_id__in=units)}
    changed = 0
    for version_id, counted in units.items():
        if version_id not in owners:
            continue
        model_id, tenant_id = owners[version_id]
        if tenant_id not in prices:
            prices[tenant_id] = effective_prices(tenant_id)
        values: dict[str, Any] = {f: counted.get(f, 0) for f in UNITS_FIELD.values()}
        values["cost"] = cost_of(values, prices[tenant_id])
        current = existing.get(version_id)
        if current is not None and all(getattr(current, f) == v for f, v in values.items()):
            continue
        UsageDay.objects.update_or_create(
            version_id=version_id,
            day=day,
            defaults={
                **values,
                "tenant_id": tenant_id,
                "model_id": model_id,
                "updated_at": timezone.now(),
            },
        )
        changed += 1
    return changed


def roll_up(today: date | None = None) -> dict[str, int]:
    """The beat task's work: today's and yesterday's usage (yesterday's last samples and
    heartbeats land after midnight), then the budgets."""
    today = today or utc_today()
    changed = roll_up_day(today - timedelta(days=1)) + roll_up_day(today)
    return {"changed": changed, **evaluate_budgets(today)}


# Reading ---------------------------------------------------------------------------------------

GROUPS = ("day", "model", "version")
FIELDS = ["requests", "rows", "tokens_in", "tokens_out", "cpu_s", "accel_s", "cost"]
MAX_RANGE_DAYS = 366


@dataclass(frozen=True)
class Window:
    start: date
    end: date  # inclusive


def parse_window(params: Mapping[str, Any], today: date | None = None) -> Window:
    """``start`` and ``end`` (ISO dates, inclusive; default the last 30 days), 400 naming the
    field for a bad date or range."""
    today = today or utc_today()
    found: dict[str, date] = {}
    for field, default in (("start", today - timedelta(days=29)), ("end", today)):
        raw = params.get(field)
        if raw in (None, ""):
            found[field] = default
            continue
        try:
            found[field] = date.fromisoformat(str(raw)[:40])
        except ValueError:
            raise Invalid(field, "a date as YYYY-MM-DD") from None
    if found["end"] < found["start"]:
        raise Invalid("end", "must not be before start")
    if (found["end"] - found["start"]).days >= MAX_RANGE_DAYS:
        raise Invalid("end", f"at most {MAX_RANGE_DAYS} days from start")
    return Window(found["start"], found["end"])


def usage_in(tenant_id: int | None, window: Window) -> QuerySet[UsageDay]:
    """The tenant's usage rows in the window (``None``: every tenant's, for operators)."""
    rows = UsageDay.objects.filter(day__gte=window.start, day__lte=window.end)
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)
    return rows


def grouped(rows: QuerySet[UsageDay], group: str, by_tenant: bool = False) -> list[dict[str, Any]]:
    """Sums per day, model or version (and per tenant for operators), in a stable order."""
    keys = {
        "day": ["day"],
        "model": ["model__name"],
        "version": ["model__name", "version__version"],
    }[group]
    if by_tenant:
        keys = ["tenant__slug", *keys]
    sums = {f: Sum(f) for f in FIELDS}
    out = []
    for row in rows.values(*keys).annotate(**sums).order_by(*keys):
        item: dict[str, Any] = {
            "tenant": row.get("tenant__slug"),
            "day": row["day"].isoformat() if "day" in row else None,
            "model": row.get("model__name"),
            "version": row.get("version__version"),
        }
        item = {k: v for k, v in item.items() if v is not None}
        for f in FIELDS:
            value = row[f] or 0
            item[f] = str(Decimal(value).quantize(CENT)) if f == "cost" else value
            if f in ("cpu_s", "accel_s"):
                item[f] = round(float(value), 6)
        out.append(item)
    return out


def totals(rows: QuerySet[UsageDay]) -> dict[str, Any]:
    """The window's sums over every row."""
    sums = rows.aggregate(**{f: Sum(f) for f in FIELDS})
    out: dict[str, Any] = {f: sums[f] or 0 for f in FIELDS}
    out["cost"] = str(Decimal(out["cost"]).quantize(CENT))
    for f in ("cpu_s", "accel_s"):
        out[f] = round(float(out[f]), 6)
    return out


def chart_series(rows: QuerySet[UsageDay]) -> dict[str, Any]:
    """Per day and model: cost (stacked by model on the page), requests, rows, tokens and
    CPU-seconds, as Plotly traces' x and y lists."""
    days: list[str] = []
    per_model: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows.values("day", "model__name").annotate(**{f: Sum(f) for f in FIELDS}):
        day = row["day"].isoformat()
        if day not in days:
            days.append(day)
        per_model.setdefault(row["model__name"], {})[day] = {f: float(row[f] or 0) for f in FIELDS}
    days.sort()
    series: dict[str, Any] = {"days": days, "models": {}}
    for model, by_day in sorted(per_model.items()):
        series["models"][model] = {f: [by_day.get(d, {}).get(f, 0.0) for d in days] for f in FIELDS}
    return series


def rolled_up_at(rows: QuerySet[UsageDay]) -> datetime | None:
    """When the roll-up last wrote any of these rows (None: none rolled up yet). The roll-up
    rewrites a row only when its sums change, so this is when these numbers last moved: no
    run of its own is recorded, and an idle tenant's stamp stays at its last change."""
    at: datetime | None = rows.aggregate(at=Max("updated_at"))["at"]
    return at


class _Line:
    """A file-like object whose ``write`` hands back the line csv.writer gave it."""

    def write(self, text: str) -> str:
        return text


CSV_FIELDS = ["tenant", "day", "model", "version", *FIELDS]


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    # A spreadsheet runs a cell starting with these as a formula: model names are the
    # tenant's own text.
    return f"'{text}" if text.startswith(("=", "+", "-", "@", "\t", "\r")) else text


def export_csv(rows: QuerySet[UsageDay]) -> Iterator[bytes]:
    """One line per tenant, day and version (a header first), streamed in chunks."""
    writer = csv.writer(_Line())
    yield writer.writerow(CSV_FIELDS).encode()
    values = (
        rows.order_by("day", "tenant__slug", "model__name", "version__version")
        .values_list("tenant__slug", "day", "model__name", "version__version", *FIELDS)
        .iterator(chunk_size=1000)
    )
    for row in values:
        cells: Iterable[Any] = (
            row[1].isoformat() if i == 1 else row[i] for i in range(len(CSV_FIELDS))
        )
        yield writer.writerow([_cell(c) for c in cells]).encode()
