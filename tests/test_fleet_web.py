"""The fleet page and the fleet's admin: a member sees the tenant's deployments (replicas,
decisions and their chart) and the agents serving it, nobody else's; the admin lists agent
sessions and deployments with their live replicas and guards deletes."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from fleet.models import AgentSession, Deployment, Pool, ScalingDecision
from fleet.nodes import create_node
from tenants.models import AuditEvent
from tests.factories import make_model, make_session, make_version

GIB = 1 << 30


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def site(world, onnx_bytes):
    """A's ``clf`` v1 and B's ``secret-b`` v1, each deployed on ``gpu-a100`` with three
    decisions; a replica of A's; B's own node ``b-box``."""
    pool = Pool.objects.create(name="gpu-a100", backend="kubernetes", namespace="ml")
    clf = make_version(make_model(world.a, "clf"), onnx_bytes)
    secret = make_version(make_model(world.b, "secret-b"), onnx_bytes)
    world.dep_a = Deployment.objects.create(
        tenant=world.a, version=clf, pool=pool, desired_replicas=2, max_replicas=6
    )
    world.dep_b = Deployment.objects.create(tenant=world.b, version=secret, pool=pool)
    start = timezone.now() - timedelta(minutes=2)
    for deployment, tag in ((world.dep_a, "alpha"), (world.dep_b, "beta")):
        for i in range(3):
            ScalingDecision.objects.create(
                deployment=deployment,
                created_at=start + timedelta(seconds=5 * i),
                current=i,
                desired=i + 1,
                accepted=i + 1 if i != 1 else None,
                reason=f"up: load {4 * i} for {tag}",
                inputs={"queue_depth": 4 * i, "in_flight": 1, "pending": 0, "p99_ms": 31.5},
                error="" if i != 1 else "quota refused",
            )
    node, _ = create_node("pool-gpu-a100")
    world.replica = make_session(node, world.dep_a.cluster_name, budget_bytes=70 * GIB)
    AgentSession.objects.filter(pk=world.replica.pk).update(
        ready_versions=[clf.pk],
        version_states={str(clf.pk): {"state": "ready", "detail": "", "memory_bytes": GIB}},
        stats={
            "queue_depth": 3,
            "in_flight": 2,
            "memory_used_bytes": GIB,
            "memory_budget_bytes": 70 * GIB,
            "gpus": [
                {
                    "index": 0,
                    "utilization_pct": 64,
                    "memory_used_bytes": 8 * GIB,
                    "memory_total_bytes": 80 * GIB,
                }
            ],
        },
    )
    b_node, _ = create_node("b-box", tenant=world.b)
    make_session(b_node)
    return world


def test_the_fleet_page_requires_sign_in(db):
    response = Client().get("/fleet/")
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_a_member_sees_the_tenants_deployments_decisions_chart_and_agents(site):
    response = signed_in(site.viewer_a).get("/fleet/")
    assert response.status_code == 200
    page = response.content.decode()
    assert '<a href="/fleet/" class="active">Fleet</a>' in page
    assert f'data-deployment="{site.dep_a.pk}"' in page
    assert "clf v1" in page and "gpu-a100" in page
    assert (
        '<b data-field="desired">2</b> desired · <b data-field="actual">1</b> live · '
        '<b data-field="ready">1</b> ready'
    ) in page
    assert "up: load 8 for alpha" in page  # the last decision's reason
    assert "refused" in page and "quota refused" in page
    assert f'id="chart-{site.dep_a.pk}"' in page and "vendor/plotly.min.js" in page
    assert 'data-agent="pool-gpu-a100"' in page and "GPU 0: 64 %" in page
    assert f"replica of {site.dep_a.cluster_name}" in page
    charts = json.loads(
        page.split('id="snapshot" type="application/json">')[1].split("</script>")[0]
    )
    assert charts[str(site.dep_a.pk)]["desired"] == [1, 2, 3]
    assert charts[str(site.dep_a.pk)]["accepted"] == [1, None, 3]


def test_another_tenants_deployments_and_nodes_are_not_shown(site):
    response = signed_in(site.engineer_a).get("/fleet/")
    page = response.content.decode()
    assert "secret-b" not in page and "for beta" not in page and "b-box" not in page
    assert f'data-deployment="{site.dep_b.pk}"' not in page
    assert list(response.context["fleet"]["charts"]) == [str(site.dep_a.pk)]


def test_an_agent_without_gpus_says_so(site):
    node, _ = create_node("cpu-box", tenant=site.a)
    make_session(node)
    page = signed_in(site.engineer_a).get("/fleet/").content.decode()
    row = page.split('data-agent="cpu-box"')[1].split("</tr>")[0]
    assert "no GPU" in row and "nothing loaded" in row and "healthy" in row


def test_with_no_deployment_the_page_says_how_to_make_one(world):
    page = signed_in(world.engineer_a).get("/fleet/").content.decode()
    assert "No deployments yet" in page and "No agent is serving Alpha" in page


# Admin ---------------------------------------------------------------------------------------


@pytest.fixture
def admin_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw-root-123")
    client.force_login(user)
    return client


def test_the_admin_lists_agent_sessions_with_health_load_memory_and_gpus(site, admin_client):
    page = admin_client.get("/admin/fleet/agentsession/").content.decode()
    assert site.dep_a.cluster_name in page and "– (run by hand)" in page
    assert "healthy (" in page and "1,024 / 71,680" in page
    assert "0: 64 %, 8,192/81,920 MiB" in page and "no GPU" in page
    change = admin_client.get(f"/admin/fleet/agentsession/{site.replica.pk}/change/")
    assert change.status_code == 200 and 'name="_save"' not in change.content.decode()


def test_the_admin_lists_deployments_with_desired_and_live_replicas(site, admin_client):
    response = admin_client.get("/admin/fleet/deployment/")
    assert response.status_code == 200
    rows = {d.pk: d.live for d in response.context["cl"].result_list}
    assert rows == {site.dep_a.pk: 1, site.dep_b.pk: 0}
    assert admin_client.get(f"/admin/fleet/deployment/{site.dep_a.pk}/change/").status_code == 200
    assert admin_client.get("/admin/fleet/scalingdecision/").status_code == 200
    assert admin_client.get("/admin/fleet/pool/").status_code == 200


def test_the_admin_refuses_to_delete_a_deployment_with_replicas(site, admin_client):
    assert admin_client.get(f"/admin/fleet/deployment/{site.dep_a.pk}/delete/").status_code == 403
    response = admin_client.post(
        f"/admin/fleet/deployment/{site.dep_b.pk}/delete/", {"post": "yes"}
    )
    assert response.status_code == 302 and not Deployment.objects.filter(pk=site.dep_b.pk).exists()
    assert AuditEvent.objects.get(action="deployment.delete").actor_label == "root"


def test_an_admin_change_is_audited_and_keeps_the_autoscalers_fields(site, admin_client):
    url = f"/admin/fleet/deployment/{site.dep_a.pk}/change/"
    form = {
        "min_replicas": 1,
        "max_replicas": 8,
        "target_load_per_replica": 8.0,
        "slo_p99_ms": "",
        "scale_down_window_s": 120,
        "idle_to_zero_s": 300,
        "cpu": "1",
        "memory": "2Gi",
        "gpus": 0,
        "mig_profile": "",
        "isolation": "shared",
        "decisions-TOTAL_FORMS": 0,
        "decisions-INITIAL_FORMS": 0,
        "decisions-MIN_NUM_FORMS": 0,
        "decisions-MAX_NUM_FORMS": 0,
    }
    response = admin_client.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]
    site.dep_a.refresh_from_db()
    assert (site.dep_a.min_replicas, site.dep_a.max_replicas) == (1, 8)
    assert site.dep_a.desired_replicas == 2
    event = AuditEvent.objects.get(action="deployment.update")
    assert (event.before["max_replicas"], event.after["max_replicas"]) == (6, 8)


def test_the_dashboard_lists_no_replica_of_another_tenant(site, world):
    from web.snapshots import dashboard_snapshot

    pool_node, _ = create_node("pool-shared")
    make_session(pool_node, world.dep_b.cluster_name, channel="b-replica")
    mine = make_session(pool_node, world.dep_a.cluster_name, channel="a-replica")
    AgentSession.objects.filter(pk=mine.pk).update(ready_versions=[world.dep_a.version_id])
    agents = dashboard_snapshot(world.a.pk)["agents"]
    assert [a["ready"] for a in agents if a["node"] == "pool-shared"] == [["clf v1"]]
    assert "secret-b" not in json.dumps(dashboard_snapshot(world.a.pk))
