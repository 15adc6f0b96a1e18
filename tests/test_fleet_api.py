"""The fleet over the API: deployments created, changed and deleted (audited, validated, one per
version and pool, never deleted under running replicas), their decisions, the pools, and the
agents a tenant sees, which never show another tenant's versions."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from fleet.deployments import update_deployment
from fleet.models import AgentSession, Deployment, Pool, ScalingDecision
from fleet.nodes import create_node
from tenants.audit import SYSTEM
from tenants.models import AuditEvent
from tests.factories import make_model, make_session, make_version
from tests.onnx_models import small_onnx

GIB = 1 << 30


def key_client(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


@pytest.fixture
def fleet(world, onnx_bytes):
    """Tenant A: ``clf`` v1 (production) and v2; tenant B: ``secret-b`` v1 deployed on the GPU
    pool. Pools: ``gpu-a100`` (Kubernetes) and ``cpu`` (local)."""
    clf = make_model(world.a, "clf")
    world.v1 = make_version(clf, onnx_bytes)
    world.v2 = make_version(clf, small_onnx(seed=3), alias=None)
    world.secret = make_version(make_model(world.b, "secret-b"), onnx_bytes)
    world.gpu = Pool.objects.create(
        name="gpu-a100", backend="kubernetes", namespace="ml", description="A100 nodes"
    )
    world.cpu = Pool.objects.create(name="cpu", backend="local")
    world.dep_b = Deployment.objects.create(tenant=world.b, version=world.secret, pool=world.gpu)
    world.client_a = key_client(world.key_a)
    return world


def deploy(client, **overrides):
    body = {"model": "clf", "version": 1, "pool": "gpu-a100", **overrides}
    return client.post("/api/v1/deployments", body, format="json")


def live(session: AgentSession, **fields) -> AgentSession:
    """What the agent's status messages and heartbeats would have stored."""
    AgentSession.objects.filter(pk=session.pk).update(**fields)
    session.refresh_from_db()
    return session


# Deployments ---------------------------------------------------------------------------------


def test_an_engineer_deploys_a_version_on_a_pool_and_it_is_audited(fleet):
    response = deploy(
        fleet.client_a,
        min_replicas=1,
        max_replicas=6,
        slo_p99_ms=50,
        cpu="500m",
        memory="4Gi",
        gpus=1,
        mig_profile="1g.10gb",
        isolation="dedicated",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["model"], body["version"], body["pool"]) == ("clf", 1, "gpu-a100")
    assert (body["min_replicas"], body["max_replicas"], body["slo_p99_ms"]) == (1, 6, 50)
    assert (body["mig_profile"], body["isolation"]) == ("1g.10gb", "dedicated")
    assert body["desired_replicas"] == 0 and body["actual_replicas"] == 0
    assert body["cluster_name"] == f"sy-agent-{body['id']}-v1"
    event = AuditEvent.objects.get(action="deployment.create")
    assert event.tenant == fleet.a and event.after["pool"] == "gpu-a100"
    assert event.after["max_replicas"] == 6


def test_the_list_has_the_tenants_deployments_only(fleet):
    deploy(fleet.client_a)
    deploy(fleet.client_a, version=2, pool="cpu")
    listed = fleet.client_a.get("/api/v1/deployments").json()
    assert [(d["model"], d["version"], d["pool"]) for d in listed] == [
        ("clf", 1, "gpu-a100"),
        ("clf", 2, "cpu"),
    ]
    theirs = key_client(fleet.key_b).get("/api/v1/deployments").json()
    assert [d["model"] for d in theirs] == ["secret-b"]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"min_replicas": 5, "max_replicas": 2}, "min_replicas"),
        ({"max_replicas": 0}, "max_replicas"),
        ({"model": "nope"}, "model"),
        ({"model": "secret-b"}, "model"),  # another tenant's model is not found either
        ({"version": 9}, "version"),
        ({"pool": "tpu"}, "pool"),
        ({"cpu": "lots"}, "cpu"),
        ({"memory": "2 GB"}, "memory"),
        ({"mig_profile": "big"}, "mig_profile"),
        ({"isolation": "private"}, "isolation"),
        ({"target_load_per_replica": 0}, "target_load_per_replica"),
        ({"desired_replicas": 3}, "desired_replicas"),
        ({"max_replica": 3}, "max_replica"),  # a typo is refused, not dropped
    ],
)
def test_bad_input_is_400_naming_the_field(fleet, overrides, field):
    response = deploy(fleet.client_a, **overrides)
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"{field}: ")
    assert not Deployment.objects.filter(tenant=fleet.a).exists()


def test_one_deployment_per_version_and_pool(fleet):
    assert deploy(fleet.client_a).status_code == 201
    again = deploy(fleet.client_a, max_replicas=8)
    assert again.status_code == 409
    assert "version 1 of 'clf' already has a deployment on pool 'gpu-a100'" in again.json()["error"]
    assert deploy(fleet.client_a, pool="cpu").status_code == 201  # another pool is fine


def test_patch_changes_settings_and_audits_before_and_after(fleet):
    created = deploy(fleet.client_a).json()
    url = f"/api/v1/deployments/{created['id']}"
    changed = fleet.client_a.patch(url, {"max_replicas": 8, "slo_p99_ms": 120}, format="json")
    assert changed.status_code == 200, changed.json()
    assert (changed.json()["max_replicas"], changed.json()["slo_p99_ms"]) == (8, 120)
    event = AuditEvent.objects.get(action="deployment.update")
    assert (event.before["max_replicas"], event.after["max_replicas"]) == (4, 8)
    assert fleet.client_a.get(url).json()["max_replicas"] == 8


@pytest.mark.parametrize(
    "body, field",
    [
        ({"desired_replicas": 3}, "desired_replicas"),
        ({"version": 2}, "version"),
        ({"pool": "cpu"}, "pool"),
        ({"min_replicas": 9}, "min_replicas"),  # above the stored max of 4
        ({"memory": "lots"}, "memory"),
    ],
)
def test_patch_refuses_read_only_identity_and_bad_fields(fleet, body, field):
    created = deploy(fleet.client_a).json()
    response = fleet.client_a.patch(f"/api/v1/deployments/{created['id']}", body, format="json")
    assert response.status_code == 400 and response.json()["error"].startswith(f"{field}: ")
    deployment = Deployment.objects.get(pk=created["id"])
    assert (deployment.desired_replicas, deployment.version, deployment.min_replicas) == (
        0,
        fleet.v1,
        0,
    )


def test_a_change_keeps_the_replicas_the_autoscaler_set_meanwhile(fleet):
    deployment = Deployment.objects.create(tenant=fleet.a, version=fleet.v1, pool=fleet.gpu)
    Deployment.objects.filter(pk=deployment.pk).update(desired_replicas=3)  # the loop scaled
    update_deployment(deployment, {"max_replicas": 6}, SYSTEM)  # from the stale read
    deployment.refresh_from_db()
    assert (deployment.desired_replicas, deployment.max_replicas) == (3, 6)


@pytest.mark.parametrize(
    "method, suffix, body",
    [
        ("get", "", None),
        ("patch", "", {"max_replicas": 1}),
        ("delete", "", None),
        ("get", "/decisions", None),
    ],
)
def test_other_tenant_gets_404(fleet, method, suffix, body):
    url = f"/api/v1/deployments/{fleet.dep_b.pk}{suffix}"
    response = getattr(fleet.client_a, method)(url, body, format="json")
    assert response.status_code == 404
    assert Deployment.objects.get(pk=fleet.dep_b.pk).max_replicas == 4


def test_delete_is_refused_while_replicas_run(fleet):
    created = deploy(fleet.client_a).json()
    url = f"/api/v1/deployments/{created['id']}"
    Deployment.objects.filter(pk=created["id"]).update(desired_replicas=2)
    refused = fleet.client_a.delete(url)
    assert refused.status_code == 409
    assert "still runs 2 replica(s): set min_replicas to 0" in refused.json()["error"]
    # Scaled to zero in the cluster, but a replica is still connected: still running.
    Deployment.objects.filter(pk=created["id"]).update(desired_replicas=0)
    node, _ = create_node("pool-gpu-a100")
    replica = make_session(node, created["cluster_name"])
    assert fleet.client_a.delete(url).status_code == 409
    live(replica, disconnected_at=timezone.now())
    assert fleet.client_a.delete(url).status_code == 204
    assert not Deployment.objects.filter(pk=created["id"]).exists()
    assert AuditEvent.objects.get(action="deployment.delete").before["version"] == 1


def test_viewers_read_but_do_not_change(fleet):
    client = APIClient()
    client.force_login(fleet.viewer_a)
    assert client.get("/api/v1/deployments").status_code == 200
    assert deploy(client).status_code == 403


# Decisions and pools -------------------------------------------------------------------------


def test_decisions_come_latest_first_with_their_inputs_and_a_limit(fleet):
    deployment = Deployment.objects.create(tenant=fleet.a, version=fleet.v1, pool=fleet.gpu)
    start = timezone.now() - timedelta(minutes=1)
    for i in range(3):
        ScalingDecision.objects.create(
            deployment=deployment,
            created_at=start + timedelta(seconds=5 * i),
            current=i,
            desired=i + 1,
            accepted=i + 1 if i < 2 else None,
            reason=f"up: step {i}",
            inputs={"queue_depth": 4 * i, "p99_ms": 12.5, "actual": i},
            error="" if i < 2 else "the cluster refused",
        )
    url = f"/api/v1/deployments/{deployment.pk}/decisions"
    rows = fleet.client_a.get(url, {"limit": 2}).json()
    assert [r["reason"] for r in rows] == ["up: step 2", "up: step 1"]
    assert rows[0]["accepted"] is None and rows[0]["error"] == "the cluster refused"
    assert rows[0]["inputs"]["queue_depth"] == 8 and rows[1]["accepted"] == 2
    assert set(rows[0]) == {
        *("id", "created_at", "current", "desired", "accepted"),
        *("dry_run", "reason", "inputs", "error"),
    }
    assert len(fleet.client_a.get(url).json()) == 3
    for bad in (0, 501, "many"):
        response = fleet.client_a.get(url, {"limit": bad})
        assert response.status_code == 400 and response.json()["error"].startswith("limit: ")


def test_every_tenant_sees_every_pool(fleet):
    for key in (fleet.key_a, fleet.key_b):
        pools = key_client(key).get("/api/v1/pools").json()
        assert pools == [
            {
                "name": "cpu",
                "backend": "local",
                "namespace": "switchyard",
                "spot": False,
                "description": "",
            },
            {
                "name": "gpu-a100",
                "backend": "kubernetes",
                "namespace": "ml",
                "spot": False,
                "description": "A100 nodes",
            },
        ]


# Agents --------------------------------------------------------------------------------------


@pytest.fixture
def agents(fleet):
    """A shared node serving both tenants' versions, B's own node, and on the pool's node one
    replica of A's deployment and one of B's."""
    fleet.dep_a = Deployment.objects.create(
        tenant=fleet.a, version=fleet.v2, pool=fleet.gpu, desired_replicas=1
    )
    a, b = str(fleet.v1.pk), str(fleet.secret.pk)
    shared_node, _ = create_node("shared-1")
    fleet.shared = live(
        make_session(shared_node, budget_bytes=8 * GIB),
        ready_versions=sorted([fleet.v1.pk, fleet.secret.pk]),
        version_states={
            a: {"state": "ready", "detail": "", "memory_bytes": GIB},
            b: {"state": "ready", "detail": "", "memory_bytes": 2 * GIB},
        },
        stats={
            "queue_depth": 7,
            "in_flight": 3,
            "p99_ms": 9.5,
            "memory_budget_bytes": 8 * GIB,
            "memory_used_bytes": 3 * GIB,
            "versions": [
                {"version_id": fleet.v1.pk, "queue_depth": 2, "in_flight": 1},
                {"version_id": fleet.secret.pk, "queue_depth": 5, "in_flight": 2},
            ],
            "gpus": [],
        },
    )
    b_node, _ = create_node("b-only", tenant=fleet.b)
    live(make_session(b_node), ready_versions=[fleet.secret.pk])
    pool_node, _ = create_node("pool-gpu-a100")
    fleet.replica = live(
        make_session(pool_node, fleet.dep_a.cluster_name, channel="replica-a"),
        ready_versions=[fleet.v2.pk],
        version_states={str(fleet.v2.pk): {"state": "ready", "detail": "", "memory_bytes": 0}},
        stats={
            "queue_depth": 1,
            "in_flight": 4,
            "memory_used_bytes": GIB,
            "memory_budget_bytes": 70 * GIB,
            "gpus": [
                {
                    "index": 0,
                    "utilization_pct": 81.0,
                    "memory_used_bytes": 20 * GIB,
                    "memory_total_bytes": 80 * GIB,
                }
            ],
        },
    )
    live(
        make_session(pool_node, fleet.dep_b.cluster_name, channel="replica-b"),
        ready_versions=[fleet.secret.pk],
    )
    return fleet


def test_agents_show_the_tenants_replicas_and_nodes_with_its_versions_only(agents):
    listed = agents.client_a.get("/api/v1/agents").json()
    by_node = {a["node"]: a for a in listed}
    assert sorted(by_node) == ["pool-gpu-a100", "shared-1"]  # not B's node nor B's replica
    shared = by_node["shared-1"]
    assert shared["serving"] == [{"model": "clf", "version": 1, "state": "ready"}]
    assert (shared["kind"], shared["shared"], shared["deployment"]) == ("node", True, None)
    # The agent's totals include B's requests: A sees its own versions' load.
    assert (shared["queue_depth"], shared["in_flight"]) == (2, 1)
    assert (shared["memory_used_bytes"], shared["memory_budget_bytes"]) == (3 * GIB, 8 * GIB)
    assert shared["health"] == "healthy" and shared["gpus"] == []
    replica = by_node["pool-gpu-a100"]
    assert replica["deployment"] == agents.dep_a.cluster_name and replica["kind"] == "replica"
    assert replica["serving"] == [{"model": "clf", "version": 2, "state": "ready"}]
    assert (replica["queue_depth"], replica["in_flight"]) == (1, 4)
    assert replica["gpus"][0]["utilization_pct"] == 81.0
    assert "secret-b" not in agents.client_a.get("/api/v1/agents").content.decode()


def test_the_other_tenant_sees_the_shared_node_with_its_own_versions(agents):
    listed = key_client(agents.key_b).get("/api/v1/agents").json()
    served = {a["node"]: a["serving"] for a in listed if a["kind"] == "node"}
    assert served == {
        "b-only": [{"model": "secret-b", "version": 1, "state": "ready"}],
        "shared-1": [{"model": "secret-b", "version": 1, "state": "ready"}],
    }
    replicas = [a["deployment"] for a in listed if a["kind"] == "replica"]
    assert replicas == [agents.dep_b.cluster_name]


def test_an_agent_missing_heartbeats_is_stale_and_then_gone(agents, settings):
    settings.SWITCHYARD_AGENT_HEARTBEAT_S = 5
    settings.SWITCHYARD_AGENT_STALE_S = 30
    live(agents.shared, last_heartbeat_at=timezone.now() - timedelta(seconds=20))
    shared = next(
        a for a in agents.client_a.get("/api/v1/agents").json() if a["node"] == "shared-1"
    )
    assert shared["health"] == "stale" and shared["last_heartbeat_age_s"] >= 20
    live(agents.shared, last_heartbeat_at=timezone.now() - timedelta(seconds=40))
    nodes = [a["node"] for a in agents.client_a.get("/api/v1/agents").json()]
    assert nodes == ["pool-gpu-a100"]


def test_a_deployment_counts_its_live_and_ready_replicas(agents):
    body = agents.client_a.get(f"/api/v1/deployments/{agents.dep_a.pk}").json()
    assert (body["desired_replicas"], body["actual_replicas"], body["ready_replicas"]) == (1, 1, 1)
    live(agents.replica, ready_versions=[])  # reconnected, still loading
    body = agents.client_a.get(f"/api/v1/deployments/{agents.dep_a.pk}").json()
    assert (body["actual_replicas"], body["ready_replicas"]) == (1, 0)


def test_deleting_an_applied_deployment_removes_its_agent_template_after_the_commit(
    fleet, monkeypatch, django_capture_on_commit_callbacks
):
    deleted = []

    class Backend:
        def delete(self, name: str) -> None:
            deleted.append(name)

    monkeypatch.setattr("fleet.deployments.backend_for", lambda pool: Backend())
    created = deploy(fleet.client_a).json()
    Deployment.objects.filter(pk=created["id"]).update(applied_template="abc")
    with django_capture_on_commit_callbacks(execute=True):
        assert fleet.client_a.delete(f"/api/v1/deployments/{created['id']}").status_code == 204
    assert deleted == [created["cluster_name"]]
