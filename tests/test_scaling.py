"""Applying autoscaler decisions through the real kubernetes client against a fake API server:
the database records only what the cluster accepted, and every attempt with its reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from fleet.autoscale import Decision
from fleet.cluster import AgentTemplate
from fleet.cluster.kubernetes import KubernetesBackend
from fleet.models import Deployment, Pool, ScalingDecision
from fleet.scaling import apply_decision, policy_of
from tests.factories import make_model, make_version
from tests.kube_fake import FakeKube, FakeKubeServer

pytestmark = pytest.mark.backends

NS = "ml"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKubeServer() as fake:
        yield fake


@pytest.fixture
def setup(world, onnx_bytes, kube):
    version = make_version(make_model(world.a, "clf"), onnx_bytes)
    pool = Pool.objects.create(name="gpu-a100", backend="kubernetes", namespace=NS)
    deployment = Deployment.objects.create(
        tenant=world.a, version=version, pool=pool, max_replicas=6, desired_replicas=1
    )
    configuration = client.Configuration(host=kube.url)
    configuration.retries = False
    backend = KubernetesBackend(
        client.ApiClient(configuration), NS, retries=2, backoff_s=0.01, timeout_s=0.5
    )
    template = AgentTemplate(
        name=deployment.cluster_name,
        namespace=NS,
        image="ghcr.io/switchyard/switchyard:0.1.0",
        platform_url="http://switchyard-web",
        token_secret="switchyard-agent-token",
        gpus=1,
    )
    backend.apply(template)
    return deployment, backend


def decision(desired: int) -> Decision:
    return Decision(desired, f"up: load → {desired}", {"queue_depth": 12.0})


def test_an_accepted_scale_moves_the_deployment_and_is_recorded(setup, kube):
    deployment, backend = setup
    record = apply_decision(deployment, decision(3), backend)
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 3 and kube.replicas(deployment.cluster_name, NS) == 3
    assert (record.current, record.desired, record.accepted, record.error) == (1, 3, 3, "")
    assert record.inputs == {"queue_depth": 12.0} and record.reason.startswith("up")


def test_a_refused_scale_leaves_the_database_honest(setup, kube):
    deployment, backend = setup
    kube.fail("PUT", "/scale", 500, times=10)
    record = apply_decision(deployment, decision(4), backend)
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 1 and kube.replicas(deployment.cluster_name, NS) == 1
    assert record.accepted is None and record.error


def test_a_dry_run_changes_nothing_but_is_recorded(setup, kube):
    deployment, backend = setup
    record = apply_decision(deployment, decision(5), backend, dry_run=True)
    deployment.refresh_from_db()
    assert deployment.desired_replicas == 1 and kube.replicas(deployment.cluster_name, NS) == 1
    assert record.dry_run and record.accepted is None
    assert ScalingDecision.objects.count() == 1


def test_the_policy_comes_from_the_deployment(setup):
    deployment, _ = setup
    policy = policy_of(deployment)
    assert (policy.min_replicas, policy.max_replicas) == (0, 6)


def test_the_admin_shows_deployments_with_their_decisions_read_only(setup, admin_client):
    deployment, backend = setup
    apply_decision(deployment, decision(2), backend)
    page = admin_client.get(f"/admin/fleet/deployment/{deployment.pk}/change/")
    text = page.content.decode()
    assert page.status_code == 200 and "up: load → 2" in text
    assert 'name="desired_replicas"' not in text  # shown, never edited by hand
    assert admin_client.get("/admin/fleet/scalingdecision/").status_code == 200
    assert admin_client.get("/admin/fleet/scalingdecision/add/").status_code == 403
