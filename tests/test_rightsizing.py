"""Right-sizing: the pure rules (each recommendation fires when its numbers say so, and only
then, carrying those numbers), the facts gathered from live sessions' heartbeats, traffic
samples and usage rows, the API (any member of the tenant; another tenant's model is a 404;
a bad window is a 400 naming the field) and the page, linked from the model page."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from fleet.models import AgentSession, Deployment, Pool
from fleet.nodes import create_node
from fleet.rightsizing import (
    Advice,
    Agent,
    Facts,
    Replica,
    VersionFacts,
    gather,
    occupancy_of,
    recommend,
)
from monitoring.models import UsageDay
from tests.factories import as_user, key_client, make_model, make_session, make_version
from tests.onnx_models import small_onnx
from tests.test_guardrails import sample

GIB = 1 << 30
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def rep(
    agent: str = "a1",
    *,
    version: int = 1,
    session: int = 1,
    requests: int = 10_000,
    runs: int = 5_000,
    rows: int = 10_000,
    run_s: float = 50.0,  # 10 ms a run, 5 ms a request
    queue_s: float = 10.0,  # 1 ms a request
    span_s: float = 1000.0,
    provider: str = CPU,
    memory: int = GIB // 2,
) -> Replica:
    return Replica(
        session_id=session,
        agent=agent,
        version=version,
        provider=provider,
        memory_bytes=memory,
        span_s=span_s,
        requests=requests,
        runs=runs,
        run_rows=rows,
        run_s=run_s,
        queue_wait_s=queue_s,
        cpu_s=run_s,
        accel_s=run_s if provider == CUDA else 0.0,
        load_avg=0.5,
    )


def ver(*replicas: Replica, **fields) -> VersionFacts:
    base = VersionFacts(
        version=1,
        max_batch_size=32,
        max_queue_delay_ms=0.0,
        latency_budget_ms=100.0,
        rate_rps=10.0,
        window_requests=9000,
        p99_ms=80.0,
        replicas=replicas or (rep(),),
    )
    return replace(base, **fields)


def advise(*versions: VersionFacts, agents: tuple[Agent, ...] = ()) -> Advice:
    return recommend(Facts(model="clf", window_s=900, versions=versions, agents=agents))


def of_kind(advice: Advice, kind: str) -> list:
    return [r for r in advice.recommendations if r.kind == kind]


# Replica count: rate x service time / target utilisation, within the deployment's bounds ------

REPLICAS = [
    # (rate/s, replicas now, deployment bounds, recommended or None)
    (100.0, 2, None, 1),  # 100 x 5 ms / 0.6 = 0.83 -> 1
    (200.0, 1, None, 2),  # 1.67 -> 2
    (500.0, 2, None, 5),  # 4.17 -> 5
    (500.0, 2, (0, 3), 3),  # capped at the deployment's maximum
    (10.0, 1, (2, 4), 2),  # held at its minimum
    (100.0, 1, None, None),  # 0.83 -> 1: as it is
    (0.0, 1, None, None),  # no traffic: a node run by hand is not scaled to zero from here
    (0.0, 2, (0, 4), 0),  # a deployment may be
]


@pytest.mark.parametrize(("rate", "now", "bounds", "wanted"), REPLICAS)
def test_replica_count(rate, now, bounds, wanted) -> None:
    replicas = tuple(rep(f"a{i}", session=i) for i in range(now))
    fields = {"rate_rps": rate}
    if bounds:
        fields |= {"deployment": "gpu", "min_replicas": bounds[0], "max_replicas": bounds[1]}
    found = of_kind(advise(ver(*replicas, **fields)), "replicas")
    if wanted is None:
        assert found == []
        return
    (rec,) = found
    assert rec.numbers["current"] == now and rec.numbers["recommended"] == wanted
    assert rec.numbers["service_ms"] == 5.0 and rec.numbers["rate_rps"] == rate
    assert f"instead of {now}" in rec.title and "target utilisation" in rec.reason


# Batching: a longer delay for empty batches with latency to spare; larger batches when full
# batches queue ------------------------------------------------------------------------------

BATCHING = [
    # (replica fields, version fields, kind expected or None, recommended)
    # 2 rows of 32 a run, p99 20 of 100 ms: the delay may take half of the 80 ms left (40),
    # less than the 150 ms that 200 requests/s take to fill a batch.
    ({}, {"p99_ms": 20.0, "rate_rps": 200.0}, "queue_delay", 40.0),
    # A busier replica fills a batch in 30 / 2000 s = 15 ms: that is the delay.
    ({}, {"p99_ms": 20.0, "rate_rps": 2000.0}, "queue_delay", 15.0),
    # No headroom: the p99 uses 60 % of the budget.
    ({}, {"p99_ms": 60.0, "rate_rps": 200.0}, None, None),
    # Batches already more than half full.
    ({"rows": 100_000}, {"p99_ms": 20.0, "rate_rps": 200.0}, None, None),
    # The delay is already that long.
    ({}, {"p99_ms": 20.0, "rate_rps": 200.0, "max_queue_delay_ms": 40.0}, None, None),
    # Batching off on purpose (max_batch_size 1).
    ({}, {"p99_ms": 20.0, "max_batch_size": 1}, None, None),
    # Full batches (31 of 32 rows) and requests waiting 20 ms for 10 ms runs: double the size.
    ({"rows": 155_000, "queue_s": 200.0}, {}, "batch_size", 64),
    # Full, but requests wait less than a run: no queueing to take away.
    ({"rows": 155_000, "queue_s": 20.0}, {}, None, None),
    # Full and queueing at the field's largest size already.
    ({"rows": 155_000 * 128, "queue_s": 200.0}, {"max_batch_size": 4096}, None, None),
]


@pytest.mark.parametrize(("rfields", "vfields", "kind", "wanted"), BATCHING)
def test_batching(rfields, vfields, kind, wanted) -> None:
    advice = advise(ver(rep(**rfields), **vfields))
    found = of_kind(advice, "queue_delay") + of_kind(advice, "batch_size")
    if kind is None:
        assert found == []
        return
    (rec,) = found
    assert rec.kind == kind and rec.numbers["recommended"] == wanted
    assert rec.numbers["max_batch_size"] == vfields.get("max_batch_size", 32)
    assert rec.numbers["occupancy"] == round(rec.numbers["rows_per_run"] / 32, 3)


def test_runs_of_requests_larger_than_a_batch_are_full_not_over_full() -> None:
    # A request of 100 rows runs alone on a version batching 32: that run is full (found in
    # the demo, where a batch job's 100-row requests read as 312 % occupancy).
    assert occupancy_of(100, 32) == 1.0 and occupancy_of(16, 32) == 0.5
    (rec,) = of_kind(advise(ver(rep(rows=500_000, queue_s=200.0))), "batch_size")
    assert rec.numbers["occupancy"] == 1.0 and rec.numbers["rows_per_run"] == 100


def test_a_queue_delay_recommendation_names_its_numbers() -> None:
    (rec,) = of_kind(advise(ver(p99_ms=20.0, rate_rps=200.0)), "queue_delay")
    assert rec.title == "v1: raise max_queue_delay_ms from 0 to 40"
    assert rec.numbers == {
        "rows_per_run": 2.0,
        "max_batch_size": 32,
        "occupancy": 0.062,
        "queue_ms": 1.0,
        "run_ms": 10.0,
        "p99_ms": 20.0,
        "latency_budget_ms": 100.0,
        "current": 0.0,
        "recommended": 40.0,
    }
    assert "p99 of 20 ms leaves 80 ms of the 100 ms budget" in rec.reason


# CPU instead of an accelerator, only on a CPU measurement ------------------------------------


def test_cpu_is_advised_when_a_cpu_measurement_fits_the_budget() -> None:
    gpu = rep("gpu-1", session=1, provider=CUDA, run_s=10.0)  # 2 ms runs
    cpu = rep("cpu-1", session=2, run_s=150.0, requests=5_000, runs=5_000)  # 30 ms runs
    advice = advise(ver(gpu, cpu, rate_rps=20.0))
    (rec,) = of_kind(advice, "cpu")
    assert rec.numbers["cpu_run_ms"] == 30.0 and rec.numbers["accelerator_run_ms"] == 2.0
    # 30 ms of run + the 1 ms requests queue today = 31 ms, within 80 % of 100 ms; 20/s x 30 ms
    # a request / 0.6 = 1 replica.
    assert rec.numbers["estimate_ms"] == 31.0 and rec.numbers["cpu_replicas"] == 1
    assert not any("CPU" in m for m in advice.missing)


def test_cpu_is_not_advised_when_the_measurement_exceeds_the_budget() -> None:
    gpu = rep("gpu-1", session=1, provider=CUDA, run_s=10.0)
    cpu = rep("cpu-1", session=2, run_s=450.0, requests=5_000, runs=5_000)  # 90 ms runs
    advice = advise(ver(gpu, cpu))
    assert of_kind(advice, "cpu") == []
    assert any("stays on CUDAExecutionProvider" in m and "90 ms" in m for m in advice.missing)


def test_without_a_cpu_measurement_the_advice_says_what_is_missing() -> None:
    advice = advise(ver(rep(provider=CUDA)))
    assert of_kind(advice, "cpu") == []
    assert any("no CPU replica of it has served yet" in m for m in advice.missing)
    # A version on CPU already has nothing to judge.
    assert not any("CPU" in m for m in advise(ver(rep())).missing)


# Consolidation: first-fit decreasing of the model's versions on under-used agents ------------


def agent(name: str, session: int, budget: int = 4 * GIB, **fields) -> Agent:
    return Agent(
        session_id=session,
        name=name,
        movable=fields.get("movable", True),
        memory_budget_bytes=budget,
        span_s=1000.0,
        other_memory_bytes=fields.get("other_memory", 0),
        other_run_s=fields.get("other_run_s", 0.0),
    )


def quiet(name: str, session: int, version: int, memory: int = GIB) -> Replica:
    # 50 s of runs in 1000 s: 5 % busy.
    return rep(name, session=session, version=version, memory=memory)


def spread(*placements: tuple[str, int, int], **version_fields) -> tuple[VersionFacts, ...]:
    """Versions 1.. each on the given (agent, session) pairs."""
    by_version: dict[int, list[Replica]] = {}
    for name, session, version in placements:
        by_version.setdefault(version, []).append(quiet(name, session, version))
    return tuple(
        ver(*rs, version=v, rate_rps=0.0, **version_fields) for v, rs in by_version.items()
    )


def test_three_quiet_agents_consolidate_onto_one() -> None:
    versions = spread(("a", 1, 1), ("b", 2, 2), ("c", 3, 3))
    agents = (agent("a", 1), agent("b", 2), agent("c", 3))
    (rec,) = of_kind(advise(*versions, agents=agents), "consolidate")
    assert len(rec.numbers["kept"]) == 1 and len(rec.numbers["freed"]) == 2
    (kept,) = rec.numbers["kept"]
    fill = rec.numbers["fill"][kept]
    assert fill["memory_bytes"] == 3 * GIB and fill["utilisation"] == 0.15
    assert len(rec.numbers["moves"]) == 2
    assert rec.title.startswith("consolidate onto 1 agent, freeing")


def test_consolidation_respects_memory_budgets() -> None:
    versions = spread(("a", 1, 1), ("b", 2, 2), ("c", 3, 3))
    # Room for two 1 GiB versions per agent: three fit on two agents.
    agents = tuple(agent(n, s, budget=2 * GIB) for n, s in (("a", 1), ("b", 2), ("c", 3)))
    (rec,) = of_kind(advise(*versions, agents=agents), "consolidate")
    assert len(rec.numbers["kept"]) == 2 and len(rec.numbers["freed"]) == 1
    # Room for one each: nothing moves.
    tight = tuple(agent(n, s, budget=GIB) for n, s in (("a", 1), ("b", 2), ("c", 3)))
    assert of_kind(advise(*versions, agents=tight), "consolidate") == []


@pytest.mark.parametrize(
    ("agents", "placements", "why"),
    [
        # Busy agents are doing their share: only two of three are under-used, and those two
        # hold replicas of one version, which cannot share an agent.
        (
            (agent("a", 1), agent("b", 2), agent("c", 3, other_run_s=500.0)),
            (("a", 1, 1), ("b", 2, 1), ("c", 3, 2)),
            "busy",
        ),
        # Replicas of a deployment are not packed (their deployment is scaled instead).
        (
            (agent("a", 1, movable=False), agent("b", 2, movable=False)),
            (("a", 1, 1), ("b", 2, 2)),
            "replicas",
        ),
        # An agent that also holds another model's version stays: nothing is freed.
        (
            (agent("a", 1, other_memory=GIB), agent("b", 2, other_memory=GIB)),
            (("a", 1, 1), ("b", 2, 2)),
            "others",
        ),
    ],
)
def test_no_consolidation(agents, placements, why) -> None:
    assert of_kind(advise(*spread(*placements), agents=agents), "consolidate") == [], why


def test_consolidation_needs_memory_budgets() -> None:
    versions = spread(("a", 1, 1), ("b", 2, 2))
    advice = advise(*versions, agents=(agent("a", 1, budget=0), agent("b", 2, budget=0)))
    assert of_kind(advice, "consolidate") == []
    assert any("report no memory budget" in m for m in advice.missing)


def test_versions_with_nothing_measured_are_named_not_judged() -> None:
    advice = advise(
        ver(version=1, replicas=()),
        replace(ver(rep(runs=0, requests=0, rows=0, run_s=0.0)), version=2),
    )
    assert advice.recommendations == []
    assert advice.missing[0].startswith("v1: no live agent serves it")
    assert advice.missing[1].startswith("v2: its agents report no model runs yet")


# Gathering from the database -----------------------------------------------------------------


def heartbeat(session: AgentSession, version_id: int, **load) -> None:
    """What the consumer stores from the agent's heartbeat and statuses, an hour in."""
    now = timezone.now()
    AgentSession.objects.filter(pk=session.pk).update(
        connected_at=now - timedelta(seconds=1000),
        last_heartbeat_at=now,
        ready_versions=[version_id],
        version_states={str(version_id): {"state": "ready", "provider": CPU}},
        stats={"load_avg": 0.4, "versions": [{"version_id": version_id, **load}]},
    )


@pytest.fixture
def served(world, onnx_bytes):
    """clf v1 of tenant A served by a node run by hand, 9,000 requests in the window."""
    world.model = make_model(world.a, "clf")
    world.v1 = make_version(world.model, onnx_bytes)
    node, _ = create_node("cpu-1")
    world.session = make_session(node, budget_bytes=4 * GIB)
    heartbeat(
        world.session,
        world.v1.pk,
        memory_bytes=GIB // 2,
        requests_total=10_000,
        runs_total=5_000,
        run_rows_total=10_000,
        run_s_total=50.0,
        queue_wait_s_total=10.0,
        cpu_s_total=45.0,
        load_s=0.0,
    )
    sample(world.v1.pk, 9_000)  # 4 ms each
    return world


def test_gather_reads_heartbeats_traffic_and_usage(served) -> None:
    UsageDay.objects.create(
        tenant=served.a,
        model=served.model,
        version=served.v1,
        day=timezone.now().date(),
        requests=4_000,
        cost=Decimal("2.0"),
    )
    facts = gather(served.model)
    (v,) = facts.versions
    assert v.version == 1 and v.window_requests == 9_000 and v.rate_rps == 10.0
    assert v.p99_ms == 5.0  # the 4 ms requests' bucket
    assert v.latency_budget_ms == 100.0  # the model's latency SLO: no deployment
    (r,) = v.replicas
    assert (r.agent, r.provider, r.requests, r.runs, r.run_rows) == (
        "cpu-1",
        CPU,
        10_000,
        5_000,
        10_000,
    )
    assert r.utilisation == pytest.approx(0.05, rel=0.01)
    assert r.queue_ms == 1.0 and r.run_ms == 10.0 and r.rows_per_run == 2.0
    assert facts.cost_per_1k == Decimal("0.5") and v.cost_per_1k == Decimal("0.5")
    (a,) = facts.agents
    assert a.movable and a.memory_budget_bytes == 4 * GIB


def test_gather_uses_a_deployments_bounds_and_slo_and_ignores_other_tenants(
    served, onnx_bytes
) -> None:
    pool = Pool.objects.create(name="gpu", backend="local")
    Deployment.objects.create(
        tenant=served.a,
        version=served.v1,
        pool=pool,
        min_replicas=1,
        max_replicas=3,
        slo_p99_ms=50.0,
    )
    # Tenant B's replica reports a version id of A's: it is not A's agent, and never counted.
    other = make_version(make_model(served.b, "secret"), small_onnx(seed=2))
    pool_b = Pool.objects.create(name="b-pool", backend="local")
    dep_b = Deployment.objects.create(tenant=served.b, version=other, pool=pool_b)
    node_b, _ = create_node("b-node", tenant=served.b)
    heartbeat(make_session(node_b, dep_b.cluster_name), served.v1.pk, runs_total=1)
    (v,) = gather(served.model).versions
    assert (v.deployment, v.min_replicas, v.max_replicas) == ("gpu", 1, 3)
    assert v.latency_budget_ms == 50.0
    assert [r.agent for r in v.replicas] == ["cpu-1"]


def test_gather_survives_a_hostile_heartbeat(served) -> None:
    AgentSession.objects.filter(pk=served.session.pk).update(
        stats={
            "versions": [
                "x",
                {"version_id": True},
                {
                    "version_id": served.v1.pk,
                    "runs_total": "many",
                    "run_s_total": -3,
                    "queue_wait_s_total": [1],
                    "requests_total": 7,
                },
            ]
        }
    )
    (v,) = gather(served.model).versions
    (r,) = v.replicas
    assert (r.runs, r.run_s, r.queue_wait_s, r.requests) == (0, 0, 0.0, 7)


# API and page --------------------------------------------------------------------------------


URL = "/api/v1/models/clf/rightsizing"


def test_the_api_answers_the_report_to_any_member(served) -> None:
    response = key_client(served.key_a).get(URL)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["model"] == "clf" and body["cost_per_1k"] is None
    (v,) = body["versions"]
    (r,) = v["replicas"]
    assert r["batch_occupancy"] == 0.062 and r["queue_ms_per_request"] == 1.0
    assert r["utilisation"] == pytest.approx(0.05, rel=0.01)
    assert v["rate_rps"] == 10.0 and v["p99_ms"] == 5.0
    # 2 rows of 32 a run and a p99 of 5 ms of 100: wait for fuller batches.
    kinds = [rec["kind"] for rec in body["recommendations"]]
    assert "queue_delay" in kinds
    assert as_user(served.viewer_a).get(URL).status_code == 200
    assert key_client(served.key_a).get(URL, {"minutes": 60}).json()["window_s"] == 3600


def test_the_api_is_tenant_scoped_and_checks_its_input(served) -> None:
    assert key_client(served.key_b).get(URL).status_code == 404
    assert key_client(served.key_a).get("/api/v1/models/nope/rightsizing").status_code == 404
    assert as_user(served.outsider).get(URL).status_code in (403, 404)
    from rest_framework.test import APIClient

    assert APIClient().get(URL).status_code == 403  # no credentials: nothing to read
    for bad in (0, 1441, "soon"):
        response = key_client(served.key_a).get(URL, {"minutes": bad})
        assert response.status_code == 400 and response.json()["error"].startswith("minutes")


def test_the_page_shows_the_numbers_and_is_linked_from_the_model_page(served) -> None:
    client = as_user(served.viewer_a)
    assert "/models/clf/rightsizing/" in client.get("/models/clf/").content.decode()
    page = client.get("/models/clf/rightsizing/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "no usage priced yet" in html
    assert "raise max_queue_delay_ms" in html and "cpu-1" in html and "6 %" in html
    # Another tenant's member finds no such model.
    from tests.factories import make_member

    stranger = make_member(served.b, "bob", "approver")
    assert as_user(stranger, "beta").get("/models/clf/rightsizing/").status_code == 404
