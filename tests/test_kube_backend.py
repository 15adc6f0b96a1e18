"""The Kubernetes backend, driven by the real ``kubernetes`` client against a fake API server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from fleet.cluster import AgentTemplate, ClusterError, NotFound
from fleet.cluster.kubernetes import KubernetesBackend, agent_deployment
from tests.kube_fake import FakeKube, FakeKubeServer

NS = "ml"
SCALE = f"/namespaces/{NS}/deployments/sy-agent-fraud-v3/scale"


def make_template(**overrides: Any) -> AgentTemplate:
    fields: dict[str, Any] = {
        "name": "sy-agent-fraud-v3",
        "namespace": NS,
        "image": "registry.example/switchyard-agent:1.4",
        "platform_url": "https://switchyard.example",
        "token_secret": "sy-node-token-fraud",
        "replicas": 2,
        "cpu": "2",
        "memory": "4Gi",
        "gpus": 1,
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
        "labels": {"switchyard.io/tenant": "alpha"},
    }
    return AgentTemplate(**(fields | overrides))


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKubeServer() as fake:
        yield fake


def make_backend(kube: FakeKube, **overrides: Any) -> KubernetesBackend:
    configuration = client.Configuration(host=kube.url)
    # No urllib3-level retries: the backend owns retrying, and the fake counts each attempt.
    configuration.retries = False
    options = {"retries": 3, "backoff_s": 0.01, "timeout_s": 0.5} | overrides
    return KubernetesBackend(client.ApiClient(configuration), NS, **options)


@pytest.fixture
def backend(kube: FakeKube) -> KubernetesBackend:
    return make_backend(kube)


@pytest.fixture
def deployed(kube: FakeKube, backend: KubernetesBackend) -> KubernetesBackend:
    backend.apply(make_template())
    kube.log.clear()
    return backend


# -- rendering ---------------------------------------------------------------------------


def test_manifest_has_the_gpu_placement_labels_and_token_from_the_secret() -> None:
    manifest = agent_deployment(make_template())
    pod = manifest["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    assert agent["name"] == "agent"
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert agent["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    # The agent reads its token from a file mounted from the Secret's "token" key.
    token_file = agent["command"][agent["command"].index("--token-file") + 1]
    mount = agent["volumeMounts"][0]
    assert token_file == f"{mount['mountPath']}/token"
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"] == {
        "secretName": "sy-node-token-fraud",
        "items": [{"key": "token", "path": "token"}],
        "defaultMode": 0o440,
    }
    assert agent["command"][:5] == [
        "python",
        "-m",
        "serving_agent",
        "--platform",
        "https://switchyard.example",
    ]
    for labels in (
        manifest["metadata"]["labels"],
        manifest["spec"]["template"]["metadata"]["labels"],
    ):
        assert labels["app.kubernetes.io/name"] == "switchyard-agent"
        assert labels["app.kubernetes.io/managed-by"] == "switchyard"
        assert labels["switchyard.io/deployment"] == "sy-agent-fraud-v3"
        assert labels["switchyard.io/tenant"] == "alpha"
    selector = manifest["spec"]["selector"]["matchLabels"]
    assert selector.items() <= manifest["spec"]["template"]["metadata"]["labels"].items()


def test_mig_profile_becomes_a_mig_resource_instead_of_a_whole_gpu() -> None:
    limits = agent_deployment(make_template(mig_profile="1g.10gb"))["spec"]["template"]["spec"][
        "containers"
    ][0]["resources"]["limits"]
    assert limits["nvidia.com/mig-1g.10gb"] == "1"
    assert "nvidia.com/gpu" not in limits


def test_cpu_only_template_has_no_accelerator_placement() -> None:
    pod = agent_deployment(make_template(gpus=0, node_selector={}, tolerations=[]))["spec"][
        "template"
    ]["spec"]
    assert set(pod["containers"][0]["resources"]["limits"]) == {"cpu", "memory"}
    assert "nodeSelector" not in pod and "tolerations" not in pod


def test_agent_pods_are_probed_locked_down_and_tokenless() -> None:
    pod = agent_deployment(make_template())["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    # The heartbeat the probes read is the one the agent is told to write.
    command = container["command"]
    alive = command[command.index("--alive-file") + 1]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe_command = container[probe]["exec"]["command"]
        assert probe_command[1] == "/app/scripts/probe_alive.py" and probe_command[2] == alive
    assert "--ready" in container["readinessProbe"]["exec"]["command"]
    assert "--ready" not in container["livenessProbe"]["exec"]["command"]
    # With a read-only root, the artifact cache and the heartbeat's directory are volumes.
    cache = command[command.index("--cache-dir") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts[cache]]
    assert "emptyDir" in volumes[mounts[alive.rsplit("/", 1)[0]]]


def test_names_that_are_not_dns_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="DNS-1123"):
        agent_deployment(make_template(name="Fraud_V3"))


@pytest.mark.parametrize("mig", [None, "1g.10gb"])
def test_manifest_validates_against_the_kubernetes_schema(mig: str | None) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (a dev dependency)"
    )
    manifest = agent_deployment(make_template(mig_profile=mig))
    kubernetes_validate.validate(manifest, "1.30", strict=True)


# -- apply ---------------------------------------------------------------------------------


def test_apply_creates_then_updates_keeping_the_scaled_replicas(
    kube: FakeKube, backend: KubernetesBackend
) -> None:
    created = backend.apply(make_template())
    stored = kube.deployments[(NS, "sy-agent-fraud-v3")]
    assert created["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
    assert stored["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":1.4")
    assert [(r.method, r.status) for r in kube.log] == [("GET", 404), ("POST", 201)]

    backend.scale("sy-agent-fraud-v3", 5)
    updated = backend.apply(make_template(image="registry.example/switchyard-agent:1.5"))
    stored = kube.deployments[(NS, "sy-agent-fraud-v3")]
    assert stored["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":1.5")
    assert updated["spec"]["replicas"] == stored["spec"]["replicas"] == 5
    put = kube.writes()[-1]
    assert put.method == "PUT" and put.body["metadata"]["resourceVersion"]


def test_apply_rereads_after_a_concurrent_write(
    kube: FakeKube, deployed: KubernetesBackend
) -> None:
    kube.fail("PUT", "/deployments/sy-agent-fraud-v3", "bump")
    deployed.apply(make_template(image="registry.example/switchyard-agent:1.5"))
    assert [(r.method, r.status) for r in kube.log] == [
        ("GET", 200),
        ("PUT", 409),
        ("GET", 200),
        ("PUT", 200),
    ]
    assert kube.deployments[(NS, "sy-agent-fraud-v3")]["spec"]["template"]["spec"]["containers"][0][
        "image"
    ].endswith(":1.5")


def test_dry_run_apply_changes_nothing(kube: FakeKube, backend: KubernetesBackend) -> None:
    would_create = backend.apply(make_template(), dry_run=True)
    assert would_create["metadata"]["name"] == "sy-agent-fraud-v3"
    assert kube.deployments == {}

    backend.apply(make_template())
    before = kube.deployments[(NS, "sy-agent-fraud-v3")]
    snapshot = repr(before)
    would = backend.apply(
        make_template(image="registry.example/switchyard-agent:2.0"), dry_run=True
    )
    assert would["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":2.0")
    assert repr(kube.deployments[(NS, "sy-agent-fraud-v3")]) == snapshot
    assert all(r.query.get("dryRun") == ["All"] for r in kube.writes()[-1:])


# -- scale ---------------------------------------------------------------------------------


def test_scale_up_and_down(kube: FakeKube, deployed: KubernetesBackend) -> None:
    up = deployed.scale("sy-agent-fraud-v3", 6)
    assert (up.accepted, up.changed, up.dry_run) == (6, True, False)
    assert kube.replicas("sy-agent-fraud-v3") == 6
    assert deployed.replicas("sy-agent-fraud-v3") == (6, 0)

    down = deployed.scale("sy-agent-fraud-v3", 1)
    assert down.accepted == 1 and kube.replicas("sy-agent-fraud-v3") == 1
    # Each write carried the resourceVersion it read, so a concurrent change would be a 409.
    assert all(r.body["metadata"]["resourceVersion"] for r in kube.writes())


def test_scale_to_the_current_count_writes_nothing(
    kube: FakeKube, deployed: KubernetesBackend
) -> None:
    result = deployed.scale("sy-agent-fraud-v3", 2)
    assert (result.accepted, result.changed) == (2, False)
    assert kube.writes() == []


def test_conflict_rereads_and_then_succeeds(kube: FakeKube, deployed: KubernetesBackend) -> None:
    kube.fail("PUT", SCALE, "bump")  # someone writes between our read and our write
    result = deployed.scale("sy-agent-fraud-v3", 4)
    assert result.accepted == 4 and kube.replicas("sy-agent-fraud-v3") == 4
    assert [(r.method, r.status) for r in kube.log] == [
        ("GET", 200),
        ("PUT", 409),
        ("GET", 200),
        ("PUT", 200),
    ]


def test_server_error_backs_off_and_then_succeeds(
    kube: FakeKube, deployed: KubernetesBackend
) -> None:
    kube.fail("PUT", SCALE, 500)
    kube.fail("GET", SCALE, 503)
    result = deployed.scale("sy-agent-fraud-v3", 3)
    assert result.accepted == 3 and kube.replicas("sy-agent-fraud-v3") == 3
    assert [r.status for r in kube.log] == [503, 200, 500, 200]


def test_persistent_server_errors_raise_and_leave_replicas_alone(
    kube: FakeKube, deployed: KubernetesBackend
) -> None:
    kube.fail("PUT", SCALE, 500, times=10)
    with pytest.raises(ClusterError, match="gave up after 4 attempts.*HTTP 500"):
        deployed.scale("sy-agent-fraud-v3", 9)
    # Nothing returned, so the caller records nothing, and the cluster agrees.
    assert kube.replicas("sy-agent-fraud-v3") == 2
    assert deployed.replicas("sy-agent-fraud-v3")[0] == 2


def test_slow_answer_times_out_and_is_retried(kube: FakeKube) -> None:
    backend = make_backend(kube, timeout_s=0.1)
    backend.apply(make_template())
    kube.fail("GET", SCALE, "slow:0.3")
    assert backend.scale("sy-agent-fraud-v3", 3).accepted == 3
    assert kube.replicas("sy-agent-fraud-v3") == 3


def test_write_that_timed_out_but_landed_is_reported_once_read_back(kube: FakeKube) -> None:
    backend = make_backend(kube, timeout_s=0.1)
    backend.apply(make_template())
    # The API stores the write but answers too late; the retry meets a 409, re-reads, and
    # finds the count already there, which is then the honest answer.
    kube.fail("PUT", SCALE, "slow:0.3")
    result = backend.scale("sy-agent-fraud-v3", 7)
    time.sleep(0.25)  # let the slow handler finish before the fake is shut down
    assert result.accepted == 7 and kube.replicas("sy-agent-fraud-v3") == 7


def test_always_slow_raises_cluster_error(kube: FakeKube) -> None:
    backend = make_backend(kube, timeout_s=0.1, retries=2)
    backend.apply(make_template())
    kube.fail("GET", SCALE, "slow:0.2", times=3)
    started = time.monotonic()
    with pytest.raises(ClusterError, match="gave up after 3 attempts.*[Tt]imeout"):
        backend.scale("sy-agent-fraud-v3", 5)
    assert time.monotonic() - started < 2
    assert kube.replicas("sy-agent-fraud-v3") == 2


def test_scale_of_a_missing_deployment_raises_not_found(backend: KubernetesBackend) -> None:
    with pytest.raises(NotFound, match="deployment ml/sy-agent-ghost does not exist"):
        backend.scale("sy-agent-ghost", 1)


def test_other_client_errors_carry_the_api_message(
    kube: FakeKube, deployed: KubernetesBackend
) -> None:
    kube.fail("PUT", SCALE, 403)
    with pytest.raises(ClusterError, match="HTTP 403"):
        deployed.scale("sy-agent-fraud-v3", 3)
    assert kube.replicas("sy-agent-fraud-v3") == 2


def test_dry_run_scale_changes_nothing(kube: FakeKube, deployed: KubernetesBackend) -> None:
    result = deployed.scale("sy-agent-fraud-v3", 8, dry_run=True)
    assert (result.dry_run, result.changed, result.accepted) == (True, True, None)
    assert "would scale 2 -> 8" in result.detail
    assert kube.replicas("sy-agent-fraud-v3") == 2
    assert kube.writes()[0].query["dryRun"] == ["All"]


# -- delete --------------------------------------------------------------------------------


def test_delete_removes_and_tolerates_missing(kube: FakeKube, deployed: KubernetesBackend) -> None:
    deployed.delete("sy-agent-fraud-v3")
    assert kube.deployments == {}
    deployed.delete("sy-agent-fraud-v3")
