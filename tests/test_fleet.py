"""The fleet: placement by memory, what each agent is assigned, and the autoscaler's control
loop on recorded heartbeat series, applied through the real kubernetes client against the fake
API server."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone
from kubernetes import client

from fleet import assignments, autoscaler, coldstart
from fleet.assignments import assignment_for, scope_versions
from fleet.cluster import ClusterError
from fleet.cluster.kubernetes import KubernetesBackend
from fleet.models import AgentSession, Deployment, Isolation, Pool, ScalingDecision
from fleet.nodes import ClaimRefused, create_node, record_heartbeat
from fleet.placement import Candidate, Item, place
from tenants.models import Quota
from tests.factories import make_model, make_session, make_version
from tests.kube_fake import FakeKube, FakeKubeServer

MB = 1 << 20
NS = "ml"


# Placement -----------------------------------------------------------------------------------


def test_first_fit_decreasing_places_every_version_once_then_adds_copies_where_room_is():
    items = [Item(1, 60 * MB, 1), Item(2, 50 * MB, 1), Item(3, 30 * MB, 1)]
    agents = [Candidate(10, 100 * MB), Candidate(11, 100 * MB)]
    result = place(items, agents)
    # 1 (60) and 2 (50) land on different agents; 3 (30) on the one with more room left;
    # then copies fill what is left: nothing else fits beside 60+30 or 50+30.
    assert result.unplaced == []
    assert sorted(map(sorted, result.assigned.values())) == [[1, 3], [2, 3]]
    for versions in result.assigned.values():
        assert sum({1: 60, 2: 50, 3: 30}[v] for v in versions) <= 100


def test_a_version_stays_where_it_is_loaded_and_an_eviction_is_respected():
    items = [Item(1, 40 * MB, 1)]
    agents = [
        Candidate(10, 100 * MB),
        Candidate(11, 50 * MB, holds=frozenset({1})),
        Candidate(12, 100 * MB, evicted=frozenset({1})),
    ]
    result = place(items, agents)
    assert 1 in result.assigned[11]  # no reload: it is already there
    assert 1 not in result.assigned[12]  # that agent measured it does not fit


def test_what_fits_nowhere_is_unplaced_and_scopes_are_kept():
    items = [Item(1, 200 * MB, 1), Item(2, 10 * MB, 2)]
    agents = [Candidate(10, 100 * MB, scope=1), Candidate(11, 0, scope=None)]
    result = place(items, agents)
    assert result.assigned[10] == []  # version 2 is tenant 2's; version 1 is too big
    assert result.assigned[11] == [1, 2]  # no budget reported: unbounded
    assert place([Item(1, 200 * MB, 1)], [Candidate(10, 100 * MB)]).unplaced == [1]


# Assignments ---------------------------------------------------------------------------------


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKubeServer() as fake:
        yield fake


@pytest.fixture
def backend(kube) -> KubernetesBackend:
    configuration = client.Configuration(host=kube.url)
    configuration.retries = False
    return KubernetesBackend(
        client.ApiClient(configuration), NS, retries=2, backoff_s=0.01, timeout_s=0.5
    )


@pytest.fixture
def deployed(world, onnx_bytes):
    """Tenant alpha: version ``served`` on a static node, ``scaled`` with a deployment."""
    served = make_version(make_model(world.a, "static-model"), onnx_bytes)
    scaled = make_version(make_model(world.a, "scaled-model"), onnx_bytes)
    pool = Pool.objects.create(name="gpu-a100", backend="kubernetes", namespace=NS)
    deployment = Deployment.objects.create(
        tenant=world.a,
        version=scaled,
        pool=pool,
        min_replicas=0,
        max_replicas=4,
        target_load_per_replica=4,
        scale_down_window_s=60,
        idle_to_zero_s=120,
    )
    return served, scaled, deployment


def ids(specs) -> list[int]:
    return [s.version_id for s in specs]


def test_a_replica_serves_its_deployment_and_a_hand_run_node_the_rest(deployed):
    served, scaled, deployment = deployed
    node, _ = create_node("pool-gpu")
    replica = make_session(node, deployment.cluster_name)
    assert replica.deployment_id == deployment.pk
    assert ids(assignment_for(node, replica.pk)) == [scaled.pk]
    by_hand, _ = create_node("box-1")
    assert ids(assignment_for(by_hand, make_session(by_hand).pk)) == [served.pk]
    # It may still download the deployed version's artifact: it is in its scope.
    assert set(scope_versions(by_hand).values_list("pk", flat=True)) == {served.pk, scaled.pk}


def test_a_replica_naming_an_unknown_deployment_serves_nothing_and_another_tenants_is_refused(
    deployed, world
):
    _, _, deployment = deployed
    node, _ = create_node("pool-x")
    assert assignment_for(node, make_session(node, "sy-agent-999-v1").pk) == []
    assert assignment_for(node, make_session(node, "not-ours").pk) == []
    beta_node, _ = create_node("beta-box", tenant=world.b)
    with pytest.raises(ClaimRefused, match="of another tenant"):
        make_session(beta_node, deployment.cluster_name)


def test_hand_run_nodes_with_small_budgets_split_the_versions_by_memory(world, onnx_bytes):
    versions = [make_version(make_model(world.a, f"m{i}"), onnx_bytes) for i in range(3)]
    need = assignments.need_of(versions[0], {})
    assert need == versions[0].artifact.size * assignments.ESTIMATE_FACTOR
    nodes = [create_node(f"box-{i}")[0] for i in range(2)]
    # Each agent has room for two versions: three versions need both agents.
    sessions = [make_session(n, budget_bytes=2 * need + 1) for n in nodes]
    placed = [set(ids(assignment_for(n, s.pk))) for n, s in zip(nodes, sessions, strict=True)]
    assert all(len(p) == 2 for p in placed)
    assert placed[0] | placed[1] == {v.pk for v in versions}
    # An agent that evicts a version is not given it again; the other keeps a copy.
    evicted = sorted(placed[0])[0]
    record_heartbeat(sessions[0].pk, nodes[0].pk, {"evicted": [evicted]})
    assert evicted not in ids(assignment_for(nodes[0], sessions[0].pk))
    assert evicted in ids(assignment_for(nodes[1], sessions[1].pk))


# The control loop ----------------------------------------------------------------------------


def beat(session: AgentSession, queue: int, in_flight: int, served: int, p99: float = 20.0):
    """One heartbeat of a replica: counters are totals, as agents send them."""
    total = (session.stats or {}).get("requests_total", 0) + served
    session.stats = {
        "queue_depth": queue,
        "in_flight": in_flight,
        "requests_total": total,
        "p99_ms": p99,
    }
    record_heartbeat(session.pk, session.node_id, session.stats)


def test_the_control_loop_rises_under_load_holds_then_scales_to_zero(deployed, backend, kube):
    _, scaled, deployment = deployed
    node, _ = create_node("pool-gpu-a100")
    t0 = timezone.now()
    replicas: list[AgentSession] = []

    def step(at_s: float, load: int, served: int) -> ScalingDecision:
        deployment.refresh_from_db()
        # The cluster started what was accepted: one live session per desired replica.
        while len(replicas) < deployment.desired_replicas:
            replicas.append(
                make_session(node, deployment.cluster_name, channel=f"r{len(replicas)}")
            )
        while len(replicas) > deployment.desired_replicas:
            AgentSession.objects.filter(pk=replicas.pop().pk).update(disconnected_at=timezone.now())
        for session in replicas:
            beat(session, load // max(len(replicas), 1), 0, served)
        return autoscaler.autoscale_deployment(deployment, backend, t0 + timedelta(seconds=at_s))

    # Idle at first: nothing to run, nothing started.
    assert step(0, 0, 0).desired == 0
    # A request held by the gateway wakes it: one replica.
    Deployment.objects.filter(pk=deployment.pk).update(woken_at=t0 + timedelta(seconds=4))
    first = step(5, 0, 0)
    assert (first.desired, first.accepted, first.inputs["pending"]) == (1, 1, 1)
    # Load of 14 in the queues at 4 per replica: 4 replicas at once (scale up fast).
    assert step(10, 14, 50).desired == 4
    assert step(15, 14, 50).desired == 4
    assert kube.replicas(deployment.cluster_name, NS) == 4
    # More load than max_replicas serves: never past 4.
    assert step(20, 40, 80).desired == 4
    # The load drops: held at 4 through the 60 s window, then down.
    assert [step(s, 2, 10).desired for s in (25, 45, 75)] == [4, 4, 4]
    down = step(90, 2, 10)
    assert down.desired == 1 and down.reason.startswith("down")
    # Idle: one warm replica until 120 s without requests, then zero.
    assert step(150, 0, 0).desired == 1
    zero = step(215, 0, 0)
    assert zero.desired == 0 and kube.replicas(deployment.cluster_name, NS) == 0
    # Every decision is stored with what it saw, including which replica holds what.
    rich = ScalingDecision.objects.filter(deployment=deployment, inputs__actual=4).first()
    assert rich.inputs["replicas_detail"][0]["agent"] == "pool-gpu-a100"
    assert ScalingDecision.objects.filter(deployment=deployment).count() == 11


def test_the_template_is_applied_once_with_what_the_replica_needs(deployed, backend, kube):
    _, _, deployment = deployed
    deployment.isolation = Isolation.DEDICATED
    deployment.gpus = 1
    deployment.save()
    autoscaler.autoscale_deployment(deployment, backend)
    autoscaler.autoscale_deployment(deployment, backend)
    applied = kube.deployments[(NS, deployment.cluster_name)]
    pod = applied["spec"]["template"]["spec"]
    env = pod["containers"][0]["env"]
    assert {"name": "SWITCHYARD_DEPLOYMENT", "value": deployment.cluster_name} in env
    assert pod["nodeSelector"]["switchyard.io/tenant"] == "alpha"
    assert pod["tolerations"][-1]["key"] == autoscaler.DEDICATED_TAINT
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    creates = [r for r in kube.writes() if r.method == "POST"]
    assert len(creates) == 1  # the second pass saw the same template and skipped it


def test_the_tenant_quota_caps_shared_deployments(deployed, backend, world, onnx_bytes):
    _, _, deployment = deployed
    Quota.objects.update_or_create(tenant=world.a, defaults={"max_replicas": 3})
    other = make_version(make_model(world.a, "other"), onnx_bytes)
    Deployment.objects.create(
        tenant=world.a, version=other, pool=deployment.pool, desired_replicas=2
    )
    node, _ = create_node("pool-q")
    session = make_session(node, deployment.cluster_name)
    beat(session, 40, 0, 100)
    decision = autoscaler.autoscale_deployment(deployment, backend)
    assert decision.desired == 1 and "quota of 3" in decision.reason


def test_an_unreachable_cluster_is_recorded_and_changes_nothing(deployed, backend, kube):
    _, _, deployment = deployed
    Deployment.objects.filter(pk=deployment.pk).update(woken_at=timezone.now())
    deployment.refresh_from_db()
    kube.fail("POST", "/deployments", 500, times=10)
    decision = autoscaler.autoscale_deployment(deployment, backend)
    deployment.refresh_from_db()
    assert decision.accepted is None and "template" in decision.error
    assert deployment.desired_replicas == 0 and deployment.applied_template == ""


def test_a_pool_without_a_reachable_cluster_still_records_decisions(deployed, monkeypatch):
    _, _, deployment = deployed

    def unreachable(pool):
        raise ClusterError("cannot reach Kubernetes: no kubeconfig")

    monkeypatch.setattr(autoscaler, "backend_for", unreachable)
    done = autoscaler.autoscale_all()
    decision = ScalingDecision.objects.get(deployment=deployment)
    assert done == {deployment.pk: decision.reason}
    assert decision.error == "no cluster backend for this pool"


def test_cold_start_wakes_the_deployment_and_reports_progress(deployed):
    _, scaled, deployment = deployed
    assert coldstart.cold_start_progress(scaled.pk)["stage"] == "scaling up"
    assert coldstart.wake(scaled.pk) is True
    deployment.refresh_from_db()
    assert deployment.woken_at is not None
    Deployment.objects.filter(pk=deployment.pk).update(desired_replicas=1)
    assert coldstart.cold_start_progress(scaled.pk)["stage"] == "starting a replica"
    node, _ = create_node("pool-c")
    make_session(node, deployment.cluster_name)
    assert coldstart.cold_start_progress(scaled.pk)["stage"] == "replica connected"
    served, _, _ = deployed
    assert coldstart.wake(served.pk) is False  # no deployment: nothing to start


def test_a_local_pool_gets_a_node_token_file_only_this_user_reads(db, settings, tmp_path):
    from fleet.cluster.local import LocalBackend
    from fleet.nodes import authenticate_node

    settings.SWITCHYARD_LOCAL_AGENTS_DIR = tmp_path
    pool = Pool.objects.create(name="local", backend="local")
    backend = autoscaler.backend_for(pool)
    assert isinstance(backend, LocalBackend)
    path = autoscaler.ensure_pool_token(pool)
    assert path.stat().st_mode & 0o777 == 0o600
    node = authenticate_node(path.read_text())
    assert node is not None and node.name == "pool-local" and node.tenant is None
    assert (
        autoscaler.ensure_pool_token(pool) == path and authenticate_node(path.read_text()) == node
    )
    path.unlink()  # lost: a new token replaces the old one
    autoscaler.ensure_pool_token(pool)
    assert authenticate_node(path.read_text()) == node


def test_a_template_gone_from_the_cluster_is_applied_again(deployed, backend, kube):
    _, _, deployment = deployed
    Deployment.objects.filter(pk=deployment.pk).update(woken_at=timezone.now())
    deployment.refresh_from_db()
    assert autoscaler.autoscale_deployment(deployment, backend).accepted == 1
    del kube.deployments[(NS, deployment.cluster_name)]  # deleted by hand
    node, _ = create_node("pool-g")
    beat(make_session(node, deployment.cluster_name), 12, 0, 30)
    deployment.refresh_from_db()
    lost = autoscaler.autoscale_deployment(deployment, backend)
    assert lost.accepted is None and "does not exist" in lost.error
    deployment.refresh_from_db()
    assert deployment.applied_template == ""
    again = autoscaler.autoscale_deployment(deployment, backend)
    assert again.accepted == again.desired and kube.replicas(deployment.cluster_name, NS) >= 1


def test_a_new_deployment_moves_the_config_generation(world, onnx_bytes):
    from fleet.changes import read_generation

    version = make_version(make_model(world.a, "gen"), onnx_bytes)
    pool = Pool.objects.create(name="p", backend="local")
    before = read_generation()
    Deployment.objects.create(tenant=world.a, version=version, pool=pool)
    # Gateways re-push assignments: hand-run nodes drop the now-deployed version.
    assert read_generation() > before


def test_the_load_averaged_over_the_heartbeat_counts_when_the_instant_misses_it(deployed, backend):
    _, _, deployment = deployed
    Deployment.objects.filter(pk=deployment.pk).update(desired_replicas=1)
    deployment.refresh_from_db()
    node, _ = create_node("pool-fast")
    session = make_session(node, deployment.cluster_name)
    # A fast model: nothing queued or running at the heartbeat's instant, 10 on average.
    stats = {"queue_depth": 0, "in_flight": 0, "load_avg": 10.0, "requests_total": 5000}
    record_heartbeat(session.pk, node.pk, stats)
    decision = autoscaler.autoscale_deployment(deployment, backend)
    assert decision.inputs["in_flight"] == 10.0
    assert decision.desired == 3  # 10 at 4 per replica
