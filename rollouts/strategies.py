"""Rollout strategies: small classes over one base, each turning a plan into traffic arms."""

from __future__ import annotations

from dataclasses import dataclass

from .models import PlanMode, RolloutPlan


@dataclass(frozen=True)
class Arm:
    name: str
    version_id: int
    weight: float  # percent of traffic


class Strategy:
    """How a plan splits traffic. ``arms`` answer clients; ``shadow`` only receives copies."""

    def arms(self, plan: RolloutPlan) -> list[Arm]:
        raise NotImplementedError

    def shadow(self, plan: RolloutPlan) -> tuple[int, float] | None:
        """(version id, share of requests copied to it), or None."""
        return None


class Canary(Strategy):
    def arms(self, plan: RolloutPlan) -> list[Arm]:
        return [
            Arm("baseline", plan.baseline_id, 100.0 - plan.weight),
            Arm("candidate", plan.candidate_id, plan.weight),
        ]


class Shadow(Strategy):
    def arms(self, plan: RolloutPlan) -> list[Arm]:
        return [Arm("baseline", plan.baseline_id, 100.0)]

    def shadow(self, plan: RolloutPlan) -> tuple[int, float] | None:
        return plan.candidate_id, plan.shadow_sample


class AB(Strategy):
    def arms(self, plan: RolloutPlan) -> list[Arm]:
        return [Arm(a.name, a.version_id, a.weight) for a in plan.arms.all()]


STRATEGIES: dict[str, Strategy] = {
    PlanMode.CANARY: Canary(),
    PlanMode.SHADOW: Shadow(),
    PlanMode.AB: AB(),
}
