"""Cluster backends for the autoscaler: one small interface (``base``) and its implementations.

``fleet.cluster.kubernetes`` is imported on its own so that this package stays light.
"""

from .base import AgentTemplate, ClusterBackend, ClusterError, NotFound, ScaleResult

__all__ = ["AgentTemplate", "ClusterBackend", "ClusterError", "NotFound", "ScaleResult"]
