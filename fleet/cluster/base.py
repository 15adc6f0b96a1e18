"""The small interface every cluster backend implements, and the values it passes around.

Nothing here imports Django: the autoscaler calls a backend and records only what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

AGENT_APP_LABEL = "switchyard-agent"
MANAGER_LABEL = "switchyard"
DEPLOYMENT_LABEL = "switchyard.io/deployment"


class ClusterError(Exception):
    """The cluster refused a change, or it stayed unreachable after every retry."""


class NotFound(ClusterError):
    """The named deployment does not exist in the cluster."""


@dataclass(frozen=True)
class AgentTemplate:
    """What one agent Deployment should look like; backends render it for their cluster."""

    name: str  # DNS-1123, e.g. "sy-agent-fraud-v3"
    namespace: str
    image: str
    platform_url: str
    token_secret: str  # a Secret holding the node token under the key "token"
    replicas: int = 1
    cpu: str = "1"  # Kubernetes quantities
    memory: str = "2Gi"
    gpus: int = 0
    mig_profile: str | None = None  # e.g. "1g.10gb" -> nvidia.com/mig-1g.10gb
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)

    def all_labels(self) -> dict[str, str]:
        """The caller's labels plus the ones the platform relies on to find its agents."""
        return {
            **self.labels,
            "app.kubernetes.io/name": AGENT_APP_LABEL,
            "app.kubernetes.io/managed-by": MANAGER_LABEL,
            DEPLOYMENT_LABEL: self.name,
        }


@dataclass(frozen=True)
class ScaleResult:
    """The outcome of a scale request. ``accepted`` is None unless the API took the change;
    it is the only number a caller may record as the deployment's desired replicas."""

    name: str
    requested: int
    accepted: int | None
    dry_run: bool
    changed: bool  # whether the desired replicas differed (or would differ, in a dry run)
    detail: str


class ClusterBackend(Protocol):
    """A place that runs agent Deployments."""

    def apply(self, template: AgentTemplate, dry_run: bool = False) -> dict[str, Any]:
        """Create or update the Deployment; return the manifest as the API accepted it."""
        ...

    def scale(self, name: str, replicas: int, dry_run: bool = False) -> ScaleResult:
        """Set the desired replicas; raise ClusterError if the API never accepted it."""
        ...

    def replicas(self, name: str) -> tuple[int, int]:
        """(desired, ready) replicas."""
        ...

    def delete(self, name: str) -> None:
        """Remove the Deployment; a missing one is not an error."""
        ...
