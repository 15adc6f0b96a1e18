"""DRF serializers of the fleet: deployments, scaling decisions, pools and agents."""

from __future__ import annotations

import re
from typing import Any

from rest_framework import serializers

from platform_site.api import MAX_INT

from ..deployments import IDENTITY, READ_ONLY, SETTINGS, replica_counts
from ..models import Deployment, Pool, ScalingDecision

CPU = re.compile(r"^\d+(\.\d+)?m?$")
MEMORY = re.compile(r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
MIG_PROFILE = re.compile(r"^[1-7]g\.\d+gb(\+me)?$")


class DeploymentSerializer(serializers.ModelSerializer[Deployment]):
    model = serializers.CharField(source="version.model.name")
    version = serializers.IntegerField(source="version.version")
    pool = serializers.CharField(source="pool.name")
    actual_replicas = serializers.SerializerMethodField(help_text="live replicas")
    ready_replicas = serializers.SerializerMethodField(
        help_text="live replicas with the version loaded and ready"
    )

    class Meta:
        model = Deployment
        fields = [
            "id",
            "model",
            "version",
            "pool",
            "cluster_name",
            *SETTINGS,
            "desired_replicas",
            "actual_replicas",
            "ready_replicas",
            "woken_at",
            "last_active_at",
            "updated_at",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "desired_replicas": {
                "help_text": "what the cluster accepted at the autoscaler's last scale"
            }
        }

    def _counts(self, deployment: Deployment) -> tuple[int, int]:
        # Counted once per response by deployment_data, not once per row.
        return self.context.get("replicas", {}).get(deployment.pk, (0, 0))

    def get_actual_replicas(self, deployment: Deployment) -> int:
        return self._counts(deployment)[0]

    def get_ready_replicas(self, deployment: Deployment) -> int:
        return self._counts(deployment)[1]


def deployment_data(deployments: list[Deployment]) -> list[dict[str, Any]]:
    counts = replica_counts(d.pk for d in deployments)
    # many=True makes a list serializer, whose data is a list; the stubs type it as one row's.
    return DeploymentSerializer(  # type: ignore[return-value]
        deployments, many=True, context={"replicas": counts}
    ).data


class DeploymentInputSerializer(serializers.ModelSerializer[Deployment]):
    """A deployment to create (model, version and pool required) or the settings to change."""

    model = serializers.CharField(max_length=100, help_text="the model's name")
    version = serializers.IntegerField(
        max_value=MAX_INT, min_value=1, help_text="the version number"
    )
    pool = serializers.CharField(max_length=63, help_text="the pool's name (GET /pools)")

    class Meta:
        model = Deployment
        fields = [*IDENTITY, *SETTINGS]
        # One deployment per version and pool is create_deployment's check: a 409 naming both.
        validators: list[Any] = []
        extra_kwargs = {
            "cpu": {"help_text": 'Kubernetes CPU quantity, e.g. "1" or "500m"'},
            "memory": {"help_text": 'Kubernetes memory quantity, e.g. "2Gi"'},
            "mig_profile": {"help_text": 'e.g. "1g.10gb": replicas ask for MIG slices'},
        }

    def validate_cpu(self, value: str) -> str:
        if not CPU.match(value):
            raise serializers.ValidationError('must be a CPU quantity such as "1", "0.5", "500m"')
        return value

    def validate_memory(self, value: str) -> str:
        if not MEMORY.match(value):
            raise serializers.ValidationError('must be a memory quantity such as "512Mi", "2Gi"')
        return value

    def validate_mig_profile(self, value: str) -> str:
        if value and not MIG_PROFILE.match(value):
            raise serializers.ValidationError('must be a MIG profile such as "1g.10gb", "3g.40gb"')
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # A misspelt or read-only field would otherwise be dropped without a word.
        refused = {k: READ_ONLY.get(k, "unknown field") for k in self.initial_data}
        refused = {k: v for k, v in refused.items() if k not in self.fields}
        if self.partial:
            refused |= {
                k: "cannot change: create a deployment of the other version or pool instead"
                for k in IDENTITY
                if k in self.initial_data
            }
        if refused:
            raise serializers.ValidationError(refused)
        return attrs


class DecisionSerializer(serializers.ModelSerializer[ScalingDecision]):
    class Meta:
        model = ScalingDecision
        fields = [
            "id",
            "created_at",
            "current",
            "desired",
            "accepted",
            "dry_run",
            "reason",
            "inputs",
            "error",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "accepted": {"help_text": "replicas the cluster accepted; null: refused or dry run"},
            "inputs": {"help_text": "the signals the decision saw (load, p99, replicas, …)"},
        }


class DecisionFilter(serializers.Serializer[Any]):
    limit = serializers.IntegerField(min_value=1, max_value=500, default=50)


class RightsizingFilter(serializers.Serializer[Any]):
    minutes = serializers.IntegerField(
        min_value=1, max_value=24 * 60, default=15, help_text="the traffic window"
    )


class PoolSerializer(serializers.ModelSerializer[Pool]):
    class Meta:
        model = Pool
        fields = ["name", "backend", "namespace", "spot", "description"]
        read_only_fields = fields


class ServedVersionSerializer(serializers.Serializer[Any]):
    model = serializers.CharField()
    version = serializers.IntegerField()
    state = serializers.CharField(help_text="loading, ready, failed or evicted")


class GpuUseSerializer(serializers.Serializer[Any]):
    index = serializers.IntegerField()
    utilization_pct = serializers.FloatField()
    memory_used_bytes = serializers.IntegerField()
    memory_total_bytes = serializers.IntegerField()


# What an agent is, in the agents and placements answers: one named enum in the OpenAPI schema
# (settings' ENUM_NAME_OVERRIDES), not a collision with approval requests' ``kind``.
AGENT_KINDS = ["replica", "node"]


class AgentSerializer(serializers.Serializer[Any]):
    node = serializers.CharField()
    kind = serializers.ChoiceField(
        choices=AGENT_KINDS, help_text="a deployment's replica, or a node run by hand"
    )
    shared = serializers.BooleanField(help_text="a node run by hand that serves every tenant")
    deployment = serializers.CharField(allow_null=True, help_text="the replica's cluster name")
    health = serializers.ChoiceField(choices=["healthy", "stale"])
    last_heartbeat_age_s = serializers.FloatField()
    serving = ServedVersionSerializer(many=True, help_text="this tenant's versions only")
    queue_depth = serializers.IntegerField()
    in_flight = serializers.IntegerField()
    p99_ms = serializers.FloatField(allow_null=True)
    memory_used_bytes = serializers.IntegerField()
    memory_budget_bytes = serializers.IntegerField()
    gpus = GpuUseSerializer(many=True)


class PlacementSerializer(serializers.Serializer[Any]):
    """One agent's hold on a version (``fleet.deployments.version_placements``)."""

    node = serializers.CharField()
    kind = serializers.ChoiceField(
        choices=AGENT_KINDS, help_text="a deployment's replica, or a node run by hand"
    )
    deployment = serializers.CharField(allow_null=True, help_text="the replica's cluster name")
    state = serializers.ChoiceField(
        choices=["loading", "ready", "failed", "evicted"],
        help_text="as the agent last reported it (loading includes building a python "
        "package's environment)",
    )
    detail = serializers.CharField(
        allow_blank=True,
        help_text="what the agent said with it: progress while loading, the installer's or "
        "loader's error when failed (at most 2,000 characters)",
    )
    provider = serializers.CharField(allow_blank=True, help_text="what runs it once loaded")
    memory_bytes = serializers.IntegerField(help_text="measured while loading")
    health = serializers.ChoiceField(choices=["healthy", "stale"])
    last_heartbeat_age_s = serializers.FloatField()
