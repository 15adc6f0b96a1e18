"""The Helm chart under deploy/helm/switchyard: `helm lint` is clean, and `helm template` for
several value sets renders objects that validate against the Kubernetes schemas (the
ServiceMonitor, a CRD the schemas lack, is checked structurally) and carry the values given."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "switchyard"
HELM = ROOT / ".venv" / "bin" / "helm"
K8S_VERSION = "1.30"

VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "external": [
        "--set", "existingSecret=prod-secrets",
        "--set", "storage.backend=s3",
        "--set", "storage.s3.bucket=models",
        "--set", "storage.s3.endpointUrl=https://s3.example.com",
        "--set", "ingress.enabled=true",
        "--set", "ingress.host=ml.example.com",
        "--set", "ingress.tls.enabled=true",
        "--set", "ingress.tls.secretName=ml-tls",
    ],
    "gpu-monitoring": [
        "--set", "gpuPools[0].name=gpu-a100",
        "--set", "gpuPools[0].nodeSelector.nvidia\\.com/gpu\\.product=A100",
        "--set", "serviceMonitor.enabled=true",
        "--set", "serviceMonitor.labels.release=prom",
        "--set", "image.agentCuda.tag=2.0-cuda12",
    ],
    "observability": [
        "--set", "prometheusRule.enabled=true",
        "--set", "prometheusRule.labels.release=prom",
        "--set", "grafanaDashboards.folder=ML platform",
        "--set", "grafanaDashboards.namespace=monitoring",
    ],
    "scaled": [
        "--set", "web.replicas=5",
        "--set", "worker.replicas=3",
        "--set", "web.resources.limits.cpu=4",
        "--set", "image.web.tag=9.9.9",
    ],
}  # fmt: skip


def _render(args: list[str]) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(HELM), "template", "rel", str(CHART), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: _render(args) for name, args in VALUE_SETS.items()}


def _get(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"].endswith(suffix):
            return doc
    raise AssertionError(f"no {kind} *{suffix}")


def _env(deployment: dict[str, Any]) -> dict[str, Any]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_helm_lint() -> None:
    result = subprocess.run(
        [str(HELM), "lint", str(CHART)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_objects_validate(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    docs = rendered[name]
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "Job", "ConfigMap", "Role"}
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):  # CRDs: checked below
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_defaults(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    web = _get(docs, "Deployment", "-web")
    assert web["spec"]["replicas"] == 2
    pod = web["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["containers"][0]["image"] == "ghcr.io/switchyard/switchyard:0.1.0"
    # Out of the Service before SIGTERM, then time to drain (gateway/drain.py).
    assert pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["terminationGracePeriodSeconds"] == 30
    assert pod["containers"][0]["command"][:3] == ["python", "-m", "platform_site.serve"]
    ports = {p["name"]: p["port"] for p in _get(docs, "Service", "-web")["spec"]["ports"]}
    assert ports == {"http": 80, "grpc": 8001}
    assert _get(docs, "Deployment", "-beat")["spec"]["replicas"] == 1
    secret = _get(docs, "Secret", "-switchyard")
    assert set(secret["stringData"]) >= {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"}
    assert _get(docs, "PersistentVolumeClaim", "-media")
    kinds = {d["kind"] for d in docs}
    assert "Ingress" not in kinds and "ServiceMonitor" not in kinds
    assert not [d for d in docs if d["metadata"]["name"].endswith("-sync-pools")]
    job = _get(docs, "Job", "-migrate")
    assert "pre-upgrade" in job["metadata"]["annotations"]["helm.sh/hook"]
    config = _get(docs, "ConfigMap", "-config")["data"]
    assert config["SWITCHYARD_AGENT_IMAGE"] == "ghcr.io/switchyard/switchyard-agent:0.1.0"


def test_external_services_s3_and_tls(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["external"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    env = _env(_get(docs, "Deployment", "-web"))
    assert env["DATABASE_URL"]["secretKeyRef"]["name"] == "prod-secrets"
    assert env["AWS_SECRET_ACCESS_KEY"]["secretKeyRef"]["name"] == "prod-secrets"
    config = _get(docs, "ConfigMap", "-config")["data"]
    assert config["SWITCHYARD_STORAGE"] == "s3"
    assert config["SWITCHYARD_S3_BUCKET"] == "models"
    assert config["SWITCHYARD_S3_ENDPOINT_URL"] == "https://s3.example.com"
    ingress = _get(docs, "Ingress", "-switchyard")["spec"]
    assert ingress["tls"] == [{"hosts": ["ml.example.com"], "secretName": "ml-tls"}]
    assert ingress["rules"][0]["host"] == "ml.example.com"


def test_gpu_pools_and_service_monitor(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["gpu-monitoring"]
    pools = _get(docs, "ConfigMap", "-gpu-pools")["data"]["pools.json"]
    assert yaml.safe_load(pools) == [
        {
            "name": "gpu-a100",
            "backend": "kubernetes",
            "namespace": "default",
            "image": "ghcr.io/switchyard/switchyard-agent-cuda:2.0-cuda12",
            "node_selector": {"nvidia.com/gpu.product": "A100"},
            "tolerations": [],
            "description": "",
            "spot": False,
        }
    ]
    job = _get(docs, "Job", "-sync-pools")
    assert job["metadata"]["annotations"]["helm.sh/hook-weight"] == "1"  # after migrate (0)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert yaml.safe_load(command[-1]) == yaml.safe_load(pools)
    config = _get(docs, "ConfigMap", "-config")["data"]
    assert config["SWITCHYARD_AGENT_CUDA_IMAGE"].endswith("switchyard-agent-cuda:2.0-cuda12")
    monitor = _get(docs, "ServiceMonitor", "-switchyard")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    web_labels = _get(docs, "Service", "-web")["metadata"]["labels"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= web_labels.items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"]["key"] == "SWITCHYARD_METRICS_TOKEN"


def test_replicas_resources_and_tags(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["scaled"]
    web = _get(docs, "Deployment", "-web")
    assert web["spec"]["replicas"] == 5
    container = web["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/switchyard/switchyard:9.9.9"
    assert str(container["resources"]["limits"]["cpu"]) == "4"
    assert _get(docs, "Deployment", "-worker")["spec"]["replicas"] == 3
    assert _get(docs, "Job", "-migrate")["spec"]["template"]["spec"]["containers"][0][
        "image"
    ].endswith(":9.9.9")


def test_the_web_pods_believe_forwarded_addresses_only_from_the_proxies_named() -> None:
    """uvicorn rewrites the client address from X-Forwarded-For only for the proxies given:
    the chart names them (web.trustedProxies) and refuses "*", under which any client could
    name its own address (and so dodge a lockout kept per address)."""

    def allowed(docs: list[dict[str, Any]]) -> str:
        command = _get(docs, "Deployment", "-web")["spec"]["template"]["spec"]["containers"][0]
        args = command["command"]
        return str(args[args.index("--forwarded-allow-ips") + 1])

    assert allowed(_render([])) == "127.0.0.1"
    assert allowed(_render(["--set", "web.trustedProxies=10.42.0.0/16"])) == "10.42.0.0/16"
    refused = subprocess.run(
        [str(HELM), "template", "rel", str(CHART), "--set", "web.trustedProxies=*"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "not *" in refused.stderr


def _dashboards(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d
        for d in docs
        if d["kind"] == "ConfigMap" and "-dashboard-" in d["metadata"]["name"]
    }


def test_dashboards_ship_as_configmaps_the_grafana_sidecar_loads(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    shipped = {
        p.name: p.read_text() for p in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")
    }
    assert len(shipped) == 5
    configmaps = _dashboards(rendered["defaults"])
    assert set(configmaps) == {
        f"rel-switchyard-dashboard-{n.removesuffix('.json')}" for n in shipped
    }
    for configmap in configmaps.values():
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert configmap["metadata"]["annotations"] == {"grafana_folder": "Switchyard"}
        assert "namespace" not in configmap["metadata"]  # the release's
        ((name, text),) = configmap["data"].items()
        assert json.loads(text) == json.loads(shipped[name])
    elsewhere = _dashboards(rendered["observability"])
    assert {c["metadata"]["namespace"] for c in elsewhere.values()} == {"monitoring"}
    assert {c["metadata"]["annotations"]["grafana_folder"] for c in elsewhere.values()} == {
        "ML platform"
    }
    assert not _dashboards(_render(["--set", "grafanaDashboards.enabled=false"]))


def test_the_prometheus_rule_holds_the_generated_rules(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    assert "PrometheusRule" not in {d["kind"] for d in rendered["defaults"]}  # needs the CRD
    rule = _get(rendered["observability"], "PrometheusRule", "-switchyard")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prom"
    generated = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"] == generated
    alerts = {r.get("alert") for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "SwitchyardErrorBudgetBurnFast" in alerts
    # Prometheus's own templates survive helm untouched (helm does not render the file).
    annotations = [
        r["annotations"]["summary"]
        for g in rule["spec"]["groups"]
        for r in g["rules"]
        if "BudgetBurn" in r.get("alert", "")
    ]
    assert len(annotations) == 4 and all("{{ $labels." in a for a in annotations)
