"""The Kubernetes backend: one agent Deployment per platform deployment, scaled through the
scale subresource with optimistic concurrency, using the official ``kubernetes`` client."""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from .base import (
    AGENT_APP_LABEL,
    DEPLOYMENT_LABEL,
    AgentTemplate,
    ClusterError,
    NotFound,
    ScaleResult,
)

T = TypeVar("T")

TOKEN_DIR = "/var/run/secrets/switchyard"
REVISION_HISTORY_LIMIT = 3
# The agent image's user (deploy/agent-gpu.yaml), its artifact cache and its heartbeat file.
AGENT_UID = 10001
CACHE_DIR = "/var/cache/switchyard-agent"
ALIVE_FILE = "/tmp/switchyard-alive"
# Label values are at most 63 characters, and the name is one (switchyard.io/deployment).
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class _Conflict(Exception):
    """409: someone else wrote since we read (or the object already exists); re-read."""


def agent_deployment(template: AgentTemplate) -> dict[str, Any]:
    """Render the apps/v1 Deployment that runs ``template``'s agents."""
    t = template
    if not DNS_LABEL.match(t.name):
        raise ValueError(f"{t.name!r} is not a DNS-1123 label (a-z, 0-9, '-', at most 63)")
    labels = t.all_labels()
    # The selector is immutable once created, so it holds only labels that never change.
    selector = {"app.kubernetes.io/name": AGENT_APP_LABEL, DEPLOYMENT_LABEL: t.name}
    resources: dict[str, dict[str, str]] = {
        "requests": {"cpu": t.cpu, "memory": t.memory},
        "limits": {"cpu": t.cpu, "memory": t.memory},
    }
    accelerator = _accelerator(t)
    if accelerator:
        # Extended resources go in limits only; Kubernetes copies them to requests.
        resources["limits"][accelerator[0]] = accelerator[1]
    container = {
        "name": "agent",
        "image": t.image,
        # The token comes as a file from the Secret rather than an argument or env var, so it
        # shows in neither `ps` nor `kubectl describe`.
        "command": [
            "python",
            "-m",
            "serving_agent",
            "--platform",
            t.platform_url,
            "--token-file",
            f"{TOKEN_DIR}/token",
            "--cache-dir",
            CACHE_DIR,
            "--alive-file",
            ALIVE_FILE,
        ],
        # The replica names its deployment in its hello: the platform assigns it that version.
        "env": [{"name": "SWITCHYARD_DEPLOYMENT", "value": t.name}],
        "resources": resources,
        # The agent refreshes its heartbeat file every 5 s from the loop that serves requests
        # (scripts/probe_alive.py reads it, standard-library Python): alive while refreshed
        # within 60 s, ready while its platform link is also open; startup allows 3 minutes.
        "startupProbe": _alive_probe(60, period_s=5, failures=36),
        "livenessProbe": _alive_probe(60, period_s=20, failures=3),
        "readinessProbe": _alive_probe(30, period_s=10, failures=3, ready=True),
        # Model code runs here: no root, no privilege escalation, no capabilities, and a
        # read-only root filesystem (artifacts go to the cache volume, the heartbeat to /tmp).
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "node-token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        # Agents never call the Kubernetes API: no token for model code to steal.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": AGENT_UID,
            "runAsGroup": AGENT_UID,
            "fsGroup": AGENT_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {
                "name": "node-token",
                "secret": {
                    "secretName": t.token_secret,
                    "items": [{"key": "token", "path": "token"}],
                    # Readable by the agent's group (fsGroup) only; 288 is octal 0440.
                    "defaultMode": 288,
                },
            },
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if t.node_selector:
        pod_spec["nodeSelector"] = dict(t.node_selector)
    if t.tolerations:
        pod_spec["tolerations"] = [dict(tol) for tol in t.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": t.name, "namespace": t.namespace, "labels": labels},
        "spec": {
            "replicas": t.replicas,
            "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def _alive_probe(
    max_age_s: int, period_s: int, failures: int, ready: bool = False
) -> dict[str, Any]:
    command = ["python", "/app/scripts/probe_alive.py", ALIVE_FILE, "--max-age", str(max_age_s)]
    if ready:
        command.append("--ready")
    return {
        "exec": {"command": command},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _accelerator(t: AgentTemplate) -> tuple[str, str] | None:
    if t.mig_profile:
        return f"nvidia.com/mig-{t.mig_profile}", str(max(t.gpus, 1))
    if t.gpus > 0:
        return "nvidia.com/gpu", str(t.gpus)
    return None


def _api_message(exc: ApiException) -> str:
    """The API's own explanation (a Status object's message), else the HTTP reason."""
    try:
        return str(json.loads(exc.body or "")["message"])
    except (ValueError, KeyError, TypeError):
        return str(exc.reason or "no message")


class KubernetesBackend:
    """Agent Deployments in one namespace.

    Every call carries a timeout; 5xx and 429 answers, timeouts and connection errors are
    retried with exponential backoff, 409 conflicts by re-reading. Whatever is returned was
    accepted by the API; anything else raises ClusterError, so a caller that records only
    returned values never claims a change the cluster did not take.
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        retries: int = 4,
        backoff_s: float = 0.2,
        timeout_s: float = 5,
    ) -> None:
        self.api_client = api_client
        self.apps = client.AppsV1Api(api_client)
        self.namespace = namespace
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s

    @classmethod
    def from_environment(cls, namespace: str, **kwargs: Any) -> KubernetesBackend:
        """In a pod, the service account; elsewhere, the kubeconfig (KUBECONFIG or ~/.kube)."""
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient(), namespace, **kwargs)

    # -- the interface -------------------------------------------------------------------

    def apply(self, template: AgentTemplate, dry_run: bool = False) -> dict[str, Any]:
        """Create the Deployment, or replace it keeping its current replicas (those belong to
        ``scale``); the replace carries the read resourceVersion, so a concurrent writer
        makes it fail with 409 and we start again from a fresh read."""
        if template.namespace != self.namespace:
            raise ValueError(f"template namespace {template.namespace!r} is not {self.namespace!r}")
        manifest = agent_deployment(template)
        name = template.name
        for _ in range(self.retries + 1):
            try:
                current = self._call(
                    "read deployment",
                    name,
                    self.apps.read_namespaced_deployment,
                    name,
                    self.namespace,
                )
            except NotFound:
                try:
                    created = self._call(
                        "create deployment",
                        name,
                        self.apps.create_namespaced_deployment,
                        self.namespace,
                        manifest,
                        dry_run=dry_run,
                    )
                except _Conflict:
                    continue  # created by someone else meanwhile: update it instead
                return self.api_client.sanitize_for_serialization(created)
            body = copy.deepcopy(manifest)
            assert current.metadata is not None  # the API always sends an object's metadata
            body["metadata"]["resourceVersion"] = current.metadata.resource_version
            if current.spec.replicas is not None:
                body["spec"]["replicas"] = current.spec.replicas
            try:
                replaced = self._call(
                    "replace deployment",
                    name,
                    self.apps.replace_namespaced_deployment,
                    name,
                    self.namespace,
                    body,
                    dry_run=dry_run,
                )
            except _Conflict:
                continue
            return self.api_client.sanitize_for_serialization(replaced)
        raise ClusterError(
            f"deployment {self._where(name)}: still conflicting after {self.retries + 1} attempts"
        )

    def scale(self, name: str, replicas: int, dry_run: bool = False) -> ScaleResult:
        """Set spec.replicas through the scale subresource.

        A dry run is validated by the API (dryRun=All) but not stored, so its result has
        ``accepted=None``: there is nothing a caller may record."""
        if replicas < 0:
            raise ValueError("replicas must be at least 0")
        for _ in range(self.retries + 1):
            current = self._call(
                "read scale of",
                name,
                self.apps.read_namespaced_deployment_scale,
                name,
                self.namespace,
            )
            before = (current.spec.replicas or 0) if current.spec else 0
            if before == replicas:
                return ScaleResult(
                    name=name,
                    requested=replicas,
                    accepted=None if dry_run else replicas,
                    dry_run=dry_run,
                    changed=False,
                    detail=f"already at {replicas} replicas",
                )
            assert current.metadata is not None  # the API always sends an object's metadata
            body = client.V1Scale(
                api_version="autoscaling/v1",
                kind="Scale",
                metadata=client.V1ObjectMeta(
                    name=name,
                    namespace=self.namespace,
                    resource_version=current.metadata.resource_version,
                ),
                spec=client.V1ScaleSpec(replicas=replicas),
            )
            try:
                written = self._call(
                    "scale",
                    name,
                    self.apps.replace_namespaced_deployment_scale,
                    name,
                    self.namespace,
                    body,
                    dry_run=dry_run,
                )
            except _Conflict:
                continue  # a concurrent write (possibly our own timed-out one): re-read
            after = (written.spec.replicas or 0) if written.spec else 0
            return ScaleResult(
                name=name,
                requested=replicas,
                accepted=None if dry_run else after,
                dry_run=dry_run,
                changed=True,
                detail=f"{'would scale' if dry_run else 'scaled'} {before} -> {after}",
            )
        raise ClusterError(
            f"scale of {self._where(name)}: still conflicting after {self.retries + 1} attempts"
        )

    def replicas(self, name: str) -> tuple[int, int]:
        deployment = self._call(
            "read deployment",
            name,
            self.apps.read_namespaced_deployment,
            name,
            self.namespace,
        )
        desired = deployment.spec.replicas if deployment.spec else None
        ready = deployment.status.ready_replicas if deployment.status else None
        return desired or 0, ready or 0

    def delete(self, name: str) -> None:
        try:
            self._call(
                "delete deployment",
                name,
                self.apps.delete_namespaced_deployment,
                name,
                self.namespace,
            )
        except NotFound:
            pass  # already gone is what the caller wanted

    # -- plumbing ------------------------------------------------------------------------

    def _where(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def _call(
        self, what: str, name: str, method: Callable[..., T], *args: Any, dry_run: bool = False
    ) -> T:
        """Run one API request with a timeout, retrying transient failures with exponential
        backoff.

        Raises _Conflict on 409 (the caller re-reads), NotFound on 404, ClusterError on other
        client errors or when every attempt failed."""
        options: dict[str, Any] = {"_request_timeout": self.timeout_s}
        if dry_run:
            options["dry_run"] = "All"
        where, last = self._where(name), ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return method(*args, **options)
            except ApiException as exc:
                status = exc.status or 0
                if status == 409:
                    raise _Conflict(_api_message(exc)) from exc
                if status == 404:
                    raise NotFound(f"deployment {where} does not exist") from exc
                last = f"HTTP {status}: {_api_message(exc)}"
                if status < 500 and status != 429:
                    raise ClusterError(f"{what} {where}: {last}") from exc
            except urllib3.exceptions.HTTPError as exc:
                # Timeouts and refused or dropped connections: the request may or may not
                # have been applied; a retried write then meets a 409 and re-reads.
                last = f"{type(exc).__name__}: {exc}"
        raise ClusterError(
            f"{what} {where}: gave up after {self.retries + 1} attempts; last error: {last}"
        )
