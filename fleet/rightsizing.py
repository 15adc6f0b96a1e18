"""Right-sizing: what a model's served versions measurably use, and what to change.

``gather`` reads the facts: every live agent session serving one of the model's versions (its
heartbeat's per-version totals: requests, model runs and their rows, run and queue-wait time,
CPU and accelerator time, the memory measured at load, the provider that runs it), the traffic
samples over a window (arrival rate, p99), the model's latency budget and each version's
deployment, and the usage roll-up (cost per 1,000 predictions). ``recommend`` is a pure
function of those facts: each recommendation comes with the numbers that justify it, and what
could not be judged says which measurement is missing. Nothing here changes anything; the
page and the API show it, and an engineer acts on it (a deployment's bounds, a version's
batching settings, a pool).

The heartbeat totals count since the version loaded on that agent; the time they cover is
taken as the session's age (heartbeat minus connection) less the version's load time, which
reads low for a version loaded long after its agent connected: utilisation errs high, so
advice to remove capacity errs on the safe side.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Q, Sum
from django.utils import timezone

from monitoring.models import UsageDay
from monitoring.traffic import arm_stats
from registry.models import Model, ModelVersion

from .models import AgentSession, Deployment
from .nodes import live_sessions

# The share of a replica's time it should spend running the model: headroom for bursts and
# for a replica lost. The autoscaler's target is queued work; this one is busy time.
TARGET_UTILISATION = 0.6
# Batches this full on average are "low occupancy" (a longer queue delay would fill them) or
# "full" (requests queue behind full batches: a larger batch takes them in one run).
LOW_OCCUPANCY = 0.5
FULL_OCCUPANCY = 0.9
# Raise the queue delay only when the p99 leaves this share of the latency budget unused, and
# spend at most half of what is left on the delay.
DELAY_HEADROOM = 0.5
# A request waiting longer than one model run on average is queueing.
QUEUEING_RUNS = 1.0
# CPU is advised when its measured compute plus today's queueing fits in this share of the
# latency budget.
CPU_BUDGET_SHARE = 0.8
# Agents busier than this are not consolidated: they are doing their share.
UNDER_USED = 0.3
MAX_BATCH_SIZE = 4096  # the version field's bound
MAX_QUEUE_DELAY_MS = 1000.0  # the version field's bound
WINDOW = timedelta(minutes=15)
USAGE_DAYS = 7


def accelerated(provider: str) -> bool:
    """Whether the runtime that loaded the version runs it on an accelerator."""
    name = provider.lower()
    return any(k in name for k in ("cuda", "tensorrt", "rocm", "migraphx", "dml", "mps"))


# Facts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    """One agent's copy of one version, from that agent's last heartbeat."""

    session_id: int
    agent: str  # the node's name
    version: int  # the version's number
    provider: str  # what runs it ("CPUExecutionProvider", "CUDAExecutionProvider", ...)
    memory_bytes: int
    span_s: float  # the time the totals below cover
    requests: int
    runs: int
    run_rows: int
    run_s: float
    queue_wait_s: float
    cpu_s: float
    accel_s: float
    load_avg: float  # the agent's queued-or-running requests on average (every version's)

    @property
    def on_accelerator(self) -> bool:
        return accelerated(self.provider) or self.accel_s > 0

    @property
    def utilisation(self) -> float | None:
        """The share of its time this replica spent running the model (None: unmeasured)."""
        if self.span_s <= 0 or self.runs == 0:
            return None
        return self.run_s / self.span_s

    @property
    def rows_per_run(self) -> float | None:
        return self.run_rows / self.runs if self.runs else None

    @property
    def queue_ms(self) -> float | None:
        """Time a request waited for its run, on average."""
        return self.queue_wait_s / self.requests * 1000 if self.requests else None

    @property
    def run_ms(self) -> float | None:
        """Wall time of one model run, on average."""
        return self.run_s / self.runs * 1000 if self.runs else None


@dataclass(frozen=True)
class Agent:
    """A live agent connection holding at least one of the model's versions."""

    session_id: int
    name: str
    movable: bool  # a node run by hand (placement decides what it holds); not a replica
    memory_budget_bytes: int
    span_s: float
    # What the agent holds and how busy it is because of other models (other tenants'
    # included): consolidation moves only this model's versions and leaves those in place.
    other_memory_bytes: int
    other_run_s: float

    @property
    def other_utilisation(self) -> float:
        return self.other_run_s / self.span_s if self.span_s > 0 else 0.0


@dataclass(frozen=True)
class VersionFacts:
    version: int
    max_batch_size: int
    max_queue_delay_ms: float
    latency_budget_ms: float  # the deployment's p99 SLO, else the model's latency SLO
    rate_rps: float  # arrivals over the window
    window_requests: int
    p99_ms: float | None  # None: no request in the window (or beyond the histogram)
    replicas: tuple[Replica, ...] = ()
    # The deployment's bounds when the version is deployed (the autoscaler keeps it within).
    deployment: str = ""  # the pool's name
    min_replicas: int = 0
    max_replicas: int | None = None
    cost_per_1k: Decimal | None = None

    def totals(self, on_accelerator: bool | None = None) -> Replica | None:
        """The replicas' totals summed (of those on an accelerator or not, when asked)."""
        chosen = [
            r for r in self.replicas if on_accelerator is None or r.on_accelerator == on_accelerator
        ]
        if not chosen:
            return None
        return Replica(
            session_id=0,
            agent=", ".join(r.agent for r in chosen),
            version=self.version,
            provider=chosen[0].provider,
            memory_bytes=max(r.memory_bytes for r in chosen),
            span_s=sum(r.span_s for r in chosen),
            requests=sum(r.requests for r in chosen),
            runs=sum(r.runs for r in chosen),
            run_rows=sum(r.run_rows for r in chosen),
            run_s=sum(r.run_s for r in chosen),
            queue_wait_s=sum(r.queue_wait_s for r in chosen),
            cpu_s=sum(r.cpu_s for r in chosen),
            accel_s=sum(r.accel_s for r in chosen),
            load_avg=sum(r.load_avg for r in chosen),
        )


@dataclass(frozen=True)
class Facts:
    model: str
    window_s: float
    versions: tuple[VersionFacts, ...]
    agents: tuple[Agent, ...] = ()
    cost_per_1k: Decimal | None = None  # over every version, the last USAGE_DAYS days
    usage_requests: int = 0


# Recommendations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    kind: str  # replicas, queue_delay, batch_size, cpu, consolidate
    title: str
    reason: str  # the rule, with the measured numbers in it
    version: int | None = None
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Advice:
    recommendations: list[Recommendation]
    missing: list[str]  # what could not be judged, and the measurement it needs


def _r(x: float, digits: int = 2) -> float:
    return round(x, digits)


def recommend(facts: Facts) -> Advice:
    """Every recommendation the facts justify, and what is missing to judge the rest."""
    recs: list[Recommendation] = []
    missing: list[str] = []
    for v in facts.versions:
        if not v.replicas:
            missing.append(f"v{v.version}: no live agent serves it, so nothing is measured")
            continue
        total = v.totals()
        assert total is not None
        if total.runs == 0 or total.requests == 0:
            missing.append(
                f"v{v.version}: its agents report no model runs yet (an agent that does not "
                "measure them, or no traffic since it loaded)"
            )
            continue
        recs += _replicas(v, total)
        recs += _batching(v, total)
        cpu, gap = _cpu(v)
        recs += cpu
        missing += gap
    consolidate, gap = _consolidate(facts.agents, facts.versions)
    recs += consolidate
    missing += gap
    return Advice(recs, missing)


def _replicas(v: VersionFacts, total: Replica) -> list[Recommendation]:
    """Arrival rate x service time / target utilisation, within the deployment's bounds."""
    service_s = total.run_s / total.requests  # a run's time shared by the requests it took
    exact = v.rate_rps * service_s / TARGET_UTILISATION
    wanted = max(math.ceil(exact - 1e-9), 1 if v.rate_rps > 0 else 0)
    bounded = max(wanted, v.min_replicas)
    if v.max_replicas is not None:
        bounded = min(bounded, v.max_replicas)
    current = len(v.replicas)
    if bounded == current or (bounded == 0 and not v.deployment):
        return []  # a node run by hand is not scaled to zero from here
    bounds = (
        f", within the deployment's {v.min_replicas} to {v.max_replicas}"
        if v.deployment and v.max_replicas is not None
        else ""
    )
    return [
        Recommendation(
            "replicas",
            f"v{v.version}: run {bounded} replica{'s' if bounded != 1 else ''} instead of "
            f"{current}",
            f"{v.rate_rps:.3g} requests/s x {service_s * 1000:.3g} ms of model time per "
            f"request / {TARGET_UTILISATION:.0%} target utilisation = {exact:.2f} replicas"
            f"{bounds}",
            v.version,
            {
                "current": current,
                "recommended": bounded,
                "rate_rps": _r(v.rate_rps, 3),
                "service_ms": _r(service_s * 1000, 3),
                "target_utilisation": TARGET_UTILISATION,
                "exact": _r(exact, 3),
            },
        )
    ]


def occupancy_of(rows_per_run: float, max_batch_size: int) -> float:
    """How full runs are, at most 1: a request of more rows than ``max_batch_size`` runs alone
    (the batcher never splits it), and that run is full, not 300 % full."""
    return min(1.0, rows_per_run / max_batch_size)


def _batching(v: VersionFacts, total: Replica) -> list[Recommendation]:
    rows = total.rows_per_run or 0.0
    occupancy = occupancy_of(rows, v.max_batch_size)
    queue_ms = total.queue_ms or 0.0
    run_ms = total.run_ms or 0.0
    base = {
        "rows_per_run": _r(rows),
        "max_batch_size": v.max_batch_size,
        "occupancy": _r(occupancy, 3),
        "queue_ms": _r(queue_ms, 3),
        "run_ms": _r(run_ms, 3),
    }
    if occupancy >= FULL_OCCUPANCY and queue_ms > QUEUEING_RUNS * run_ms:
        if v.max_batch_size >= MAX_BATCH_SIZE:
            return []
        size = min(v.max_batch_size * 2, MAX_BATCH_SIZE)
        return [
            Recommendation(
                "batch_size",
                f"v{v.version}: raise max_batch_size from {v.max_batch_size} to {size}",
                f"runs take {rows:.3g} rows of {v.max_batch_size} ({occupancy:.0%} full) and "
                f"requests wait {queue_ms:.3g} ms for a run of {run_ms:.3g} ms: they queue "
                "behind full batches",
                v.version,
                base | {"recommended": size},
            )
        ]
    if v.max_batch_size == 1 or occupancy >= LOW_OCCUPANCY or v.p99_ms is None:
        return []
    left_ms = v.latency_budget_ms - v.p99_ms
    if left_ms < DELAY_HEADROOM * v.latency_budget_ms:
        return []
    # The wait that would gather a full batch at one replica's share of the arrivals, but at
    # most half of the latency left unused.
    per_replica = v.rate_rps / len(v.replicas)
    if per_replica <= 0:
        return []
    fill_ms = (v.max_batch_size - rows) / per_replica * 1000
    delay = min(fill_ms, left_ms / 2, MAX_QUEUE_DELAY_MS)
    delay = math.floor(delay * 10) / 10
    if delay <= v.max_queue_delay_ms + 0.5:
        return []
    return [
        Recommendation(
            "queue_delay",
            f"v{v.version}: raise max_queue_delay_ms from {v.max_queue_delay_ms:g} to {delay:g}",
            f"runs take {rows:.3g} rows of {v.max_batch_size} ({occupancy:.0%} full) and the "
            f"p99 of {v.p99_ms:g} ms leaves {left_ms:g} ms of the {v.latency_budget_ms:g} ms "
            f"budget: waiting up to {delay:g} ms (half of that, or the time "
            f"{per_replica:.3g} requests/s per replica take to fill a batch) fills batches "
            "for fewer, larger runs",
            v.version,
            base
            | {
                "p99_ms": v.p99_ms,
                "latency_budget_ms": v.latency_budget_ms,
                "current": v.max_queue_delay_ms,
                "recommended": delay,
            },
        )
    ]


def _cpu(v: VersionFacts) -> tuple[list[Recommendation], list[str]]:
    """CPU instead of an accelerator, only on a CPU measurement of this very version."""
    gpu = v.totals(on_accelerator=True)
    if gpu is None:
        return [], []
    cpu = v.totals(on_accelerator=False)
    if cpu is None or not cpu.runs or not cpu.requests:
        return [], [
            f"v{v.version}: runs on {gpu.provider}; no CPU replica of it has served yet, so "
            "whether CPU meets its latency budget is unmeasured (deploy one replica on a CPU "
            "pool, or a node without an accelerator, and come back)"
        ]
    run_ms = cpu.run_ms or 0.0
    queue_ms = gpu.queue_ms or 0.0
    estimate = run_ms + queue_ms
    share = CPU_BUDGET_SHARE * v.latency_budget_ms
    numbers = {
        "cpu_run_ms": _r(run_ms, 3),
        "accelerator_run_ms": _r(gpu.run_ms or 0.0, 3),
        "queue_ms": _r(queue_ms, 3),
        "latency_budget_ms": v.latency_budget_ms,
    }
    if estimate > share:
        return [], [
            f"v{v.version}: stays on {gpu.provider}: a CPU run takes {run_ms:.3g} ms, and with "
            f"{queue_ms:.3g} ms of queueing that exceeds {share:g} ms "
            f"({CPU_BUDGET_SHARE:.0%} of the {v.latency_budget_ms:g} ms budget)"
        ]
    service_s = cpu.run_s / cpu.requests
    replicas = max(1, math.ceil(v.rate_rps * service_s / TARGET_UTILISATION - 1e-9))
    return [
        Recommendation(
            "cpu",
            f"v{v.version}: serve it on CPU ({replicas} replica{'s' if replicas != 1 else ''})",
            f"measured on CPU a run takes {run_ms:.3g} ms (on {gpu.provider} "
            f"{gpu.run_ms or 0.0:.3g} ms); with {queue_ms:.3g} ms of queueing that is "
            f"{estimate:.3g} ms, within {CPU_BUDGET_SHARE:.0%} of the "
            f"{v.latency_budget_ms:g} ms budget; {v.rate_rps:.3g} requests/s need {replicas} "
            f"CPU replica{'s' if replicas != 1 else ''} at {TARGET_UTILISATION:.0%}",
            v.version,
            numbers | {"estimate_ms": _r(estimate, 3), "cpu_replicas": replicas},
        )
    ], []


@dataclass
class _Bin:
    agent: Agent
    memory: int
    busy: float
    versions: set[int]
    moved_in: list[int] = field(default_factory=list)


def _consolidate(
    agents: Sequence[Agent], versions: Sequence[VersionFacts]
) -> tuple[list[Recommendation], list[str]]:
    """First-fit decreasing: the model's versions on under-used agents, largest memory first,
    each onto the first agent (fullest first) with room in memory and below the target
    utilisation that does not hold it already. An agent left holding nothing is freed."""
    movable = [a for a in agents if a.movable]
    by_agent: dict[int, list[Replica]] = {}
    for v in versions:
        for r in v.replicas:
            by_agent.setdefault(r.session_id, []).append(r)
    under: list[tuple[Agent, list[Replica]]] = []
    for a in movable:
        held = by_agent.get(a.session_id, [])
        busy = a.other_utilisation + sum(r.utilisation or 0.0 for r in held)
        if held and busy < UNDER_USED:
            under.append((a, held))
    if len(under) < 2:
        return [], []
    unknown = [a.name for a, _ in under if a.memory_budget_bytes <= 0]
    if unknown:
        return [], [
            f"consolidation: agent(s) {', '.join(unknown)} report no memory budget, so what "
            "fits where is unknown"
        ]
    bins = [
        _Bin(a, a.other_memory_bytes, a.other_utilisation, set())
        for a, _ in sorted(
            under, key=lambda x: (-(x[0].other_memory_bytes + _mem(x[1])), x[0].name)
        )
    ]
    items = sorted(
        (r for _, held in under for r in held), key=lambda r: (-r.memory_bytes, r.version)
    )
    placed: dict[int, str] = {}
    for item in items:
        for b in bins:
            fits = b.memory + item.memory_bytes <= b.agent.memory_budget_bytes
            cool = b.busy + (item.utilisation or 0.0) <= TARGET_UTILISATION
            if fits and cool and item.version not in b.versions:
                b.memory += item.memory_bytes
                b.busy += item.utilisation or 0.0
                b.versions.add(item.version)
                b.moved_in.append(item.version)
                placed[id(item)] = b.agent.name
                break
        else:
            return [], [
                f"consolidation: v{item.version} ({item.memory_bytes / 2**20:,.0f} MiB) fits "
                "on no other under-used agent"
            ]
    used = [b for b in bins if b.versions or b.agent.other_memory_bytes]
    freed = [b.agent.name for b in bins if not b.versions and not b.agent.other_memory_bytes]
    if not freed:
        return [], []
    moves = [
        {"version": r.version, "from": r.agent, "to": placed[id(r)]}
        for r in items
        if placed[id(r)] != r.agent
    ]
    return [
        Recommendation(
            "consolidate",
            f"consolidate onto {len(used)} agent{'s' if len(used) != 1 else ''}, freeing "
            f"{', '.join(freed)}",
            f"{len(under)} agents each run the model under {UNDER_USED:.0%} of the time; "
            "packing their versions largest memory first into the first agent with room "
            f"(memory budget, {TARGET_UTILISATION:.0%} utilisation) needs {len(used)}",
            None,
            {
                "agents": [a.name for a, _ in under],
                "kept": [b.agent.name for b in used],
                "freed": freed,
                "moves": moves,
                "fill": {
                    b.agent.name: {
                        "memory_bytes": b.memory,
                        "memory_budget_bytes": b.agent.memory_budget_bytes,
                        "utilisation": _r(b.busy, 3),
                    }
                    for b in used
                },
            },
        )
    ], []


def _mem(replicas: Iterable[Replica]) -> int:
    return sum(r.memory_bytes for r in replicas)


# Gathering -----------------------------------------------------------------------------------


def _number(value: Any) -> float:
    """A heartbeat figure as a number (an agent's JSON is not trusted to hold one)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return max(float(value), 0.0)


def gather(model: Model, window: timedelta = WINDOW) -> Facts:
    """The facts of ``model`` (a model already looked up through its tenant)."""
    now = timezone.now()
    versions = list(model.versions.order_by("version"))
    by_id = {v.pk: v for v in versions}
    sessions = list(
        live_sessions()
        .filter(
            Q(deployment__isnull=True, deployment_name="") | Q(deployment__tenant=model.tenant_id)
        )
        .select_related("node")
        .order_by("pk")
    )
    replicas: dict[int, list[Replica]] = {}
    agents: list[Agent] = []
    for session in sessions:
        held, other_memory, other_run_s, span = _loads(session, by_id)
        if not held:
            continue
        for vid, load, load_s in held:
            state = (session.version_states or {}).get(str(vid)) or {}
            provider = state.get("provider") if isinstance(state, dict) else ""
            replicas.setdefault(vid, []).append(
                Replica(
                    session_id=session.pk,
                    agent=session.node.name,
                    version=by_id[vid].version,
                    provider=provider if isinstance(provider, str) else "",
                    memory_bytes=int(_number(load.get("memory_bytes"))),
                    span_s=max(span - load_s, 0.0),
                    requests=int(_number(load.get("requests_total"))),
                    runs=int(_number(load.get("runs_total"))),
                    run_rows=int(_number(load.get("run_rows_total"))),
                    run_s=_number(load.get("run_s_total")),
                    queue_wait_s=_number(load.get("queue_wait_s_total")),
                    cpu_s=_number(load.get("cpu_s_total")),
                    accel_s=_number(load.get("accel_s_total")),
                    load_avg=_number((session.stats or {}).get("load_avg")),
                )
            )
        agents.append(
            Agent(
                session_id=session.pk,
                name=session.node.name,
                movable=not session.deployment_name,
                memory_budget_bytes=session.memory_budget_bytes,
                span_s=span,
                other_memory_bytes=other_memory,
                other_run_s=other_run_s,
            )
        )
    deployments = {
        d.version_id: d
        for d in Deployment.objects.filter(version__model=model).select_related("pool")
    }
    since = now - window
    per_version_cost = _costs(model, now)
    facts = []
    for v in versions:
        stats = arm_stats(v.pk, since)
        live = replicas.get(v.pk, [])
        if not live and not stats.requests and v.pk not in deployments:
            continue  # neither served nor deployed: nothing to size
        d = deployments.get(v.pk)
        p99 = stats.p99_ms if stats.requests else None
        facts.append(
            VersionFacts(
                version=v.version,
                max_batch_size=v.max_batch_size,
                max_queue_delay_ms=v.max_queue_delay_ms,
                latency_budget_ms=(d.slo_p99_ms if d and d.slo_p99_ms else model.slo_latency_ms),
                rate_rps=stats.requests / window.total_seconds(),
                window_requests=stats.requests,
                p99_ms=p99 if p99 is not None and math.isfinite(p99) else None,
                replicas=tuple(live),
                deployment=d.pool.name if d else "",
                min_replicas=d.min_replicas if d else 0,
                max_replicas=d.max_replicas if d else None,
                cost_per_1k=per_version_cost.get(v.pk),
            )
        )
    total_cost, total_requests = _usage_totals(model, now)
    return Facts(
        model=model.name,
        window_s=window.total_seconds(),
        versions=tuple(facts),
        agents=tuple(agents),
        cost_per_1k=per_1k(total_cost, total_requests),
        usage_requests=total_requests,
    )


def _loads(
    session: AgentSession, ours: dict[int, ModelVersion]
) -> tuple[list[tuple[int, dict[str, Any], float]], int, float, float]:
    """The model's versions in a session's heartbeat (with their load and load time), the
    memory and run time of the others it holds, and the time its totals cover."""
    stats = session.stats if isinstance(session.stats, dict) else {}
    loads = stats.get("versions")
    span = max((session.last_heartbeat_at - session.connected_at).total_seconds(), 0.0)
    held: list[tuple[int, dict[str, Any], float]] = []
    other_memory, other_run_s = 0, 0.0
    ready = set(session.ready_versions or [])
    for load in loads if isinstance(loads, list) else []:
        if not isinstance(load, dict):
            continue
        vid = load.get("version_id")
        if not isinstance(vid, int) or isinstance(vid, bool):
            continue
        if vid in ours and vid in ready:
            held.append((vid, load, _number(load.get("load_s"))))
        else:
            other_memory += int(_number(load.get("memory_bytes")))
            other_run_s += _number(load.get("run_s_total"))
    return held, other_memory, other_run_s, span


def per_1k(cost: Decimal, requests: int) -> Decimal | None:
    """Cost per 1,000 predictions; None when nothing was priced yet."""
    if not requests:
        return None
    return (cost / requests * 1000).quantize(Decimal("0.000001"))


def _costs(model: Model, now: Any) -> dict[int, Decimal | None]:
    start = (now - timedelta(days=USAGE_DAYS)).date()
    rows = (
        UsageDay.objects.filter(model=model, tenant_id=model.tenant_id, day__gte=start)
        .values("version_id")
        .annotate(cost=Sum("cost"), requests=Sum("requests"))
    )
    return {r["version_id"]: per_1k(r["cost"] or Decimal(0), r["requests"] or 0) for r in rows}


def _usage_totals(model: Model, now: Any) -> tuple[Decimal, int]:
    start = (now - timedelta(days=USAGE_DAYS)).date()
    totals = UsageDay.objects.filter(
        model=model, tenant_id=model.tenant_id, day__gte=start
    ).aggregate(cost=Sum("cost"), requests=Sum("requests"))
    return totals["cost"] or Decimal(0), totals["requests"] or 0


def report(model: Model, window: timedelta = WINDOW) -> dict[str, Any]:
    """The facts and the advice as JSON-ready data: what the API answers, the page shows."""
    facts = gather(model, window)
    advice = recommend(facts)
    return {
        "model": facts.model,
        "window_s": facts.window_s,
        "usage_days": USAGE_DAYS,
        "cost_per_1k": _money(facts.cost_per_1k),
        "usage_requests": facts.usage_requests,
        "versions": [_version_data(v) for v in facts.versions],
        "recommendations": [asdict(r) for r in advice.recommendations],
        "missing": advice.missing,
        "rules": {
            "target_utilisation": TARGET_UTILISATION,
            "low_occupancy": LOW_OCCUPANCY,
            "full_occupancy": FULL_OCCUPANCY,
            "under_used": UNDER_USED,
            "cpu_budget_share": CPU_BUDGET_SHARE,
        },
    }


def _money(value: Decimal | None) -> str | None:
    return None if value is None else str(value)


def _version_data(v: VersionFacts) -> dict[str, Any]:
    total = v.totals()
    return {
        "version": v.version,
        "deployment_pool": v.deployment or None,
        "min_replicas": v.min_replicas if v.deployment else None,
        "max_replicas": v.max_replicas,
        "max_batch_size": v.max_batch_size,
        "max_queue_delay_ms": v.max_queue_delay_ms,
        "latency_budget_ms": v.latency_budget_ms,
        "rate_rps": _r(v.rate_rps, 3),
        "window_requests": v.window_requests,
        "p99_ms": v.p99_ms,
        "cost_per_1k": _money(v.cost_per_1k),
        "replicas": [_replica_data(r, v.max_batch_size) for r in v.replicas],
        "totals": _replica_data(total, v.max_batch_size) if total else None,
    }


def _replica_data(r: Replica, max_batch_size: int) -> dict[str, Any]:
    def maybe(x: float | None, digits: int = 3) -> float | None:
        return None if x is None else _r(x, digits)

    rows = r.rows_per_run
    return {
        "agent": r.agent,
        "provider": r.provider,
        "on_accelerator": r.on_accelerator,
        "memory_bytes": r.memory_bytes,
        "requests": r.requests,
        "runs": r.runs,
        "utilisation": maybe(r.utilisation),
        "load_avg": _r(r.load_avg, 3),
        "rows_per_run": maybe(rows),
        "batch_occupancy": maybe(occupancy_of(rows, max_batch_size) if rows is not None else None),
        "queue_ms_per_request": maybe(r.queue_ms),
        "run_ms": maybe(r.run_ms),
        "cpu_ms_per_run": maybe(r.cpu_s / r.runs * 1000 if r.runs else None),
        "accel_ms_per_run": maybe(r.accel_s / r.runs * 1000 if r.runs else None),
    }
