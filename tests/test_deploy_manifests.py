"""The Kubernetes manifests under deploy/: every object validates against the Kubernetes
schemas, beat is a singleton, the autoscaler's RBAC is least privilege, secrets never appear
inline, the commands agree with deploy/supervisord.conf's (what `make up` runs), and every
long-running container has probes that mean something."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
# The oldest Kubernetes release still widely supported, and the newest the package ships.
K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
SECRET_ENV = {
    "DATABASE_URL",
    "REDIS_URL",
    "SECRET_KEY",
    "CELERY_BROKER_URL",
    "SWITCHYARD_METRICS_TOKEN",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"}


def _manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _objects() -> list[tuple[str, dict]]:
    return [(p.name, doc) for p in _manifest_files() for doc in _load(p)]


def _find(kind: str, name: str) -> dict:
    for _, doc in _objects():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} under deploy/")


def _pod_spec(doc: dict) -> dict:
    spec = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]["spec"]


def _workloads() -> list[tuple[str, dict]]:
    return [(f, d) for f, d in _objects() if d["kind"] in WORKLOAD_KINDS]


def _containers(doc: dict) -> list[dict]:
    pod = _pod_spec(doc)
    return pod.get("initContainers", []) + pod["containers"]


def _command(doc: dict, container: str | None = None) -> list[str]:
    for c in _containers(doc):
        if container is None or c["name"] == container:
            return list(c.get("command", [])) + list(c.get("args", []))
    raise AssertionError(f"no container {container} in {doc['metadata']['name']}")


def _supervisord() -> configparser.RawConfigParser:
    config = configparser.RawConfigParser()  # raw: the %(ENV_X)s stay as written
    config.read(DEPLOY / "supervisord.conf")
    return config


def _supervised() -> dict[str, list[str]]:
    """Each program of deploy/supervisord.conf as the image runs it: ``$PY -m uvicorn ...`` is
    ``uvicorn ...``, ``$PY -m serving_agent ...`` is ``python -m serving_agent ...``."""
    out = {}
    config = _supervisord()
    for section in config.sections():
        if section.startswith("program:"):
            argv = shlex.split(config[section]["command"])
            assert argv[0] == "%(ENV_PY)s", section  # the virtual environment's interpreter
            argv = argv[2:] if argv[2] in ("uvicorn", "celery") else ["python", *argv[1:]]
            out[section.removeprefix("program:")] = argv
    return out


def _option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_deploy_directory_has_manifests():
    names = {p.name for p in _manifest_files()}
    for expected in (
        "namespace.yaml",
        "config.yaml",
        "secret.example.yaml",
        "web.yaml",
        "migrate-job.yaml",
        "worker.yaml",
        "beat.yaml",
        "agent-gpu.yaml",
        "rbac.yaml",
    ):
        assert expected in names
    assert (DEPLOY / "README.md").is_file()


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "path", _manifest_files(), ids=lambda p: p.name if isinstance(p, Path) else str(p)
)
def test_manifest_validates_against_kubernetes_schema(path, version):
    docs = _load(path)
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_kustomize_output_validates():
    """What `kubectl apply -k deploy/` would send: every object, in the switchyard namespace."""
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    shipped = [d for f, d in _objects() if not f.endswith(".example.yaml")]
    assert len(docs) == len(shipped)
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "switchyard"
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "switchyard"
        if doc["kind"] in WORKLOAD_KINDS:
            for c in _containers(doc):
                # Agents run the agent's own CUDA image (agent/Dockerfile.cuda), the rest the
                # platform's.
                expected = (
                    "ghcr.io/switchyard/switchyard-agent:0.1.0-cuda"
                    if c["name"] == "agent"
                    else "ghcr.io/switchyard/switchyard:0.1.0"
                )
                assert c["image"] == expected


def test_kustomization_lists_every_manifest_but_the_example_secret():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "switchyard"
    listed = set(kustomization["resources"])
    shipped = {p.name for p in _manifest_files() if not p.name.endswith(".example.yaml")}
    assert listed == shipped
    # Applying the kustomization must never overwrite real secrets with placeholders.
    assert not any(name.endswith(".example.yaml") for name in listed)
    assert all(d["kind"] != "Secret" for f, d in _objects() if f in listed)
    images = {i["name"]: i for i in kustomization["images"]}
    assert "ghcr.io/switchyard/switchyard" in images
    assert images["ghcr.io/switchyard/switchyard-agent"]["newTag"] == "0.1.0-cuda"


def test_namespaced_objects_live_in_switchyard():
    namespace = _find("Namespace", "switchyard")
    assert namespace["apiVersion"] == "v1"
    for _, doc in _objects():
        ns = doc["metadata"].get("namespace")
        assert ns in (None, "switchyard"), f"{doc['kind']} {doc['metadata']['name']} in {ns}"


def test_beat_is_a_singleton():
    beat = _find("Deployment", "switchyard-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    argv = _command(beat)
    assert argv[:4] == ["celery", "-A", "platform_site", "beat"]
    # No other workload runs beat (e.g. `worker -B`).
    for _, doc in _workloads():
        if doc is not beat and doc["metadata"]["name"] != "switchyard-beat":
            for c in _containers(doc):
                argv = list(c.get("command", [])) + list(c.get("args", []))
                assert "beat" not in argv and "-B" not in argv and "--beat" not in argv


def test_autoscaler_rbac_is_least_privilege():
    kinds = {d["kind"] for _, d in _objects()}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    role = _find("Role", "switchyard-autoscaler")
    rules = {tuple(r["resources"]): r for r in role["rules"]}
    assert set(rules) == {("deployments",), ("deployments/scale",)}
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["apps"]
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "deletecollection" not in rule["verbs"]
        assert "resourceNames" not in rule or rule["resourceNames"]
    assert set(rules[("deployments",)]["verbs"]) == {
        "get",
        "list",
        "watch",
        "create",
        "patch",
        "update",
        "delete",  # KubernetesBackend.delete; nothing else, and never a whole collection
    }
    assert set(rules[("deployments/scale",)]["verbs"]) == {"get", "patch", "update"}

    binding = _find("RoleBinding", "switchyard-autoscaler")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "switchyard-autoscaler",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "switchyard-autoscaler", "namespace": "switchyard"}
    ]
    _find("ServiceAccount", "switchyard-autoscaler")

    # Only the Celery pods run as the autoscaler; everything else has no API token at all.
    for _, doc in _workloads():
        pod = _pod_spec(doc)
        name = doc["metadata"]["name"]
        if name in ("switchyard-worker", "switchyard-beat"):
            assert pod["serviceAccountName"] == "switchyard-autoscaler"
        else:
            assert pod.get("serviceAccountName") in (None, "default")
            assert pod["automountServiceAccountToken"] is False, name


def test_agent_runs_on_gpu_nodes():
    agent = _find("Deployment", "switchyard-agent-gpu")
    pod = _pod_spec(agent)
    (container,) = pod["containers"]
    resources = container["resources"]
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    argv = _command(agent)
    assert argv[:3] == ["python", "-m", "serving_agent"]
    assert _option(argv, "--platform") == "http://switchyard-web"
    token_file = Path(_option(argv, "--token-file"))
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = mounts[str(token_file.parent)]
    (secret_volume,) = [v for v in pod["volumes"] if v["name"] == volume]
    assert secret_volume["secret"]["secretName"] == "switchyard-agent-token"
    assert "--token" not in argv


def test_web_service_probes_and_storage():
    web = _find("Deployment", "switchyard-web")
    assert web["spec"]["replicas"] == 2
    pod = _pod_spec(web)
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    port = _option(_command(web), "--port")
    assert {"name": "http", "containerPort": int(port), "protocol": "TCP"} in container["ports"]
    service = _find("Service", "switchyard-web")
    assert service["spec"]["selector"] == web["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == 80  # the agents' --platform http://switchyard-web
    # OIP v2 over gRPC on the gateway's default port (SWITCHYARD_GRPC_PORT), in the pod, on the
    # Service and in the image.
    assert {"name": "grpc", "containerPort": 8001, "protocol": "TCP"} in container["ports"]
    grpc_service = {"name": "grpc", "port": 8001, "targetPort": "grpc", "protocol": "TCP"}
    assert grpc_service in service["spec"]["ports"]
    assert "EXPOSE 8000 8001" in (ROOT / "Dockerfile").read_text()
    # The agents reach Django (artifact downloads) under the Service's name.
    hosts = _find("ConfigMap", "switchyard-config")["data"]["ALLOWED_HOSTS"].split(",")
    assert "switchyard-web" in hosts
    claim = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert [v["persistentVolumeClaim"]["claimName"] for v in claim] == ["switchyard-media"]


def test_the_probe_paths_are_answered_by_the_gateway(monkeypatch):
    # Ask the real ASGI application for each path the web pod's probes name: liveness is 200
    # at once; readiness answers in the protocol's shape (503 until the first routing refresh).
    from asgiref.sync import async_to_sync
    from channels.testing import HttpCommunicator

    from gateway import oip
    from gateway.state import GatewayState

    monkeypatch.setattr(oip, "get_state", GatewayState)
    container = _pod_spec(_find("Deployment", "switchyard-web"))["containers"][0]
    probes = {
        kind: container[kind]["httpGet"]["path"] for kind in ("livenessProbe", "readinessProbe")
    }

    async def ask(path: str) -> dict:
        return await HttpCommunicator(oip.oip_app, "GET", path).get_response(timeout=10)

    assert async_to_sync(ask)(probes["livenessProbe"])["status"] == 200
    assert async_to_sync(ask)(probes["readinessProbe"])["status"] == 503
    assert async_to_sync(ask)("/v2/health/nope")["status"] == 404


def test_every_container_has_resources_and_a_hardened_context():
    for _, doc in _workloads():
        pod = _pod_spec(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in _containers(doc):
            where = f"{doc['metadata']['name']}/{c['name']}"
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), f"{where} {part}"
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["capabilities"]["drop"] == ["ALL"], where
            # A read-only root needs a writable /tmp.
            assert "/tmp" in {m["mountPath"] for m in c.get("volumeMounts", [])}, where


def test_secrets_come_from_secret_references_never_inline():
    for _, doc in _workloads():
        for c in _containers(doc):
            where = f"{doc['metadata']['name']}/{c['name']}"
            for var in c.get("env", []):
                if var["name"] in SECRET_ENV or "TOKEN" in var["name"]:
                    assert "value" not in var, f"{where}: {var['name']} inline"
                    assert "secretKeyRef" in var["valueFrom"], f"{where}: {var['name']}"
            for source in c.get("envFrom", []):
                assert set(source) <= {"configMapRef", "secretRef", "prefix"}, where
            argv = list(c.get("command", [])) + list(c.get("args", []))
            assert "--token" not in argv, where
    # The ConfigMap holds no secret.
    config = _find("ConfigMap", "switchyard-config")["data"]
    assert not SECRET_ENV & set(config)
    assert not any("TOKEN" in k or "PASSWORD" in k for k in config)


def test_django_processes_get_the_external_database_and_redis():
    for name in ("switchyard-web", "switchyard-worker", "switchyard-beat", "switchyard-migrate"):
        kind = "Job" if name == "switchyard-migrate" else "Deployment"
        (container,) = _pod_spec(_find(kind, name))["containers"]
        refs = {
            v["name"]: v["valueFrom"]["secretKeyRef"]
            for v in container.get("env", [])
            if "secretKeyRef" in v.get("valueFrom", {})
        }
        for key in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY"):
            assert refs[key] == {"name": "switchyard", "key": key}, f"{name} {key}"
        assert {"configMapRef": {"name": "switchyard-config"}} in container["envFrom"]


def test_every_web_pod_gets_the_one_metrics_token_prometheus_is_given():
    (container,) = _pod_spec(_find("Deployment", "switchyard-web"))["containers"]
    refs = {v["name"]: v.get("valueFrom", {}) for v in container["env"]}
    assert refs["SWITCHYARD_METRICS_TOKEN"] == {
        "secretKeyRef": {"name": "switchyard", "key": "SWITCHYARD_METRICS_TOKEN"}
    }


def test_example_secret_documents_every_key():
    secrets = {d["metadata"]["name"]: d for d in _load(DEPLOY / "secret.example.yaml")}
    assert set(secrets["switchyard"]["stringData"]) == {
        "DATABASE_URL",
        "REDIS_URL",
        "SECRET_KEY",
        "SWITCHYARD_METRICS_TOKEN",
    }
    assert set(secrets["switchyard-agent-token"]["stringData"]) == {"token"}
    assert all("CHANGE-ME" in v for v in secrets["switchyard"]["stringData"].values())


def test_migrate_job_runs_migrations():
    job = _find("Job", "switchyard-migrate")
    assert _command(job) == ["python", "manage.py", "migrate", "--noinput"]
    assert _pod_spec(job)["restartPolicy"] in ("OnFailure", "Never")


def test_commands_agree_with_supervisord_conf():
    procfile = _supervised()
    web = _command(_find("Deployment", "switchyard-web"))
    # uvicorn's command line through platform_site.serve (its parent stops listening at SIGTERM).
    assert web[:3] == procfile["web"][:3] == ["python", "-m", "platform_site.serve"]
    assert web[3] == procfile["web"][3] == "platform_site.asgi:application"
    # Every way of running the web process bounds half-sent requests' headers (408).
    bounded = "gateway.http_bounds:BoundedHttpProtocol"
    assert _option(web, "--http") == _option(procfile["web"], "--http") == bounded
    for process in ("worker", "beat"):
        argv = _command(_find("Deployment", f"switchyard-{process}"))
        assert argv[0] == procfile[process][0] == "celery"
        assert _option(argv, "-A") == _option(procfile[process], "-A") == "platform_site"
        assert argv[3] == procfile[process][3] == process
    agent = _command(_find("Deployment", "switchyard-agent-gpu"))
    assert agent[:3] == procfile["agent"][:3] == ["python", "-m", "serving_agent"]
    # The Dockerfile's default command is the web process too.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert '"platform_site.serve", "platform_site.asgi:application"' in dockerfile
    assert f'"--http", "{bounded}"' in dockerfile


def test_supervisord_restarts_each_process_alone_with_backoff():
    config = _supervisord()
    assert config["supervisord"]["nodaemon"] == "true"  # make up runs it in the foreground
    programs = {s.removeprefix("program:") for s in config.sections() if s.startswith("program:")}
    assert programs == {"web", "worker", "beat", "agent"}
    for name in programs:
        program = config[f"program:{name}"]
        assert program["autorestart"] == "true", name
        # A process failing at start is retried with supervisord's growing delay, not forever.
        assert int(program["startsecs"]) > 0 and 0 < int(program["startretries"]) <= 20, name
        # uvicorn's and Celery's child processes stop with their parent.
        assert program["stopasgroup"] == program["killasgroup"] == "true", name
    # make up runs this file.
    assert "supervisord -c deploy/supervisord.conf" in (ROOT / "scripts" / "up.sh").read_text()


def _probe_file(container: dict) -> str:
    """The heartbeat file a worker, beat or agent container is told to refresh."""
    env = {v["name"]: v.get("value") for v in container.get("env", [])}
    argv = list(container.get("command", [])) + list(container.get("args", []))
    if "--alive-file" in argv:
        return _option(argv, "--alive-file")
    return env["SWITCHYARD_ALIVE_FILE"]


def _run_probe(command: list[str], path: Path) -> int:
    """Run a probe's command here: the image's /app is this repository, the pod's file is path."""
    argv = [sys.executable if a == "python" else a for a in command]
    argv = [str(ROOT / a.removeprefix("/app/")) if a.startswith("/app/") else a for a in argv]
    argv[argv.index("/tmp/switchyard-alive")] = str(path)
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


@pytest.mark.parametrize("name", ["switchyard-worker", "switchyard-beat", "switchyard-agent-gpu"])
def test_processes_without_http_have_heartbeat_probes(name, tmp_path):
    """Liveness passes on a fresh heartbeat whatever it says and fails on a stale one;
    readiness needs the line ``ready`` too; startup gives the first heartbeat time."""
    (container,) = _pod_spec(_find("Deployment", name))["containers"]
    assert _probe_file(container) == "/tmp/switchyard-alive"  # in the writable /tmp emptyDir
    probes = {k: container[k]["exec"]["command"] for k in ("startupProbe", "livenessProbe")}
    probes["readinessProbe"] = container["readinessProbe"]["exec"]["command"]
    assert "--ready" in probes["readinessProbe"] and "--ready" not in probes["livenessProbe"]
    assert (
        container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"]
        >= 60
    )
    heartbeat = tmp_path / "alive"
    assert _run_probe(probes["livenessProbe"], heartbeat) == 1  # no heartbeat yet
    heartbeat.write_text("not ready: no broker connection\n")
    assert _run_probe(probes["livenessProbe"], heartbeat) == 0
    assert _run_probe(probes["readinessProbe"], heartbeat) == 1
    heartbeat.write_text("ready\n")
    assert _run_probe(probes["readinessProbe"], heartbeat) == 0
    stale = time.time() - 120
    os.utime(heartbeat, (stale, stale))
    assert _run_probe(probes["livenessProbe"], heartbeat) == 1
    assert _run_probe(probes["readinessProbe"], heartbeat) == 1


def test_the_web_server_believes_forwarded_addresses_only_from_named_proxies():
    """Never ``--forwarded-allow-ips "*"``: any client could then name its own address."""
    for path in sorted((ROOT / "deploy").rglob("*.yaml")) + [ROOT / "deploy" / "supervisord.conf"]:
        text = path.read_text()
        if "--forwarded-allow-ips" in text:
            after = text.split("--forwarded-allow-ips", 1)[1].lstrip().lstrip("-").strip()
            assert not after.startswith(('"*"', "'*'", "*", "=*")), path


def test_web_pods_leave_the_service_before_they_drain():
    """A web pod is out of the Service's endpoints (preStop sleep) before SIGTERM starts its
    drain, and is given the time to finish its requests (gateway/drain.py)."""
    web = _find("Deployment", "switchyard-web")
    pod = _pod_spec(web)
    container = pod["containers"][0]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["terminationGracePeriodSeconds"] >= 5 + 10 + 5
