"""The autoscaler's decision: how many replicas a deployment should run, from its agents' signals.

Pure functions over recorded signals, so the control loop, its tests and the simulation in
``bench/autoscale_sim.py`` all run the same decision. The leading signals of tail latency are
the work waiting and running on the replicas (queue depth plus in-flight requests) and the p99
against the version's SLO; CPU alone lags them.

- Scale up fast: at once to what the latest signal asks for, at most doubling (or +4) per
  decision, within ``max_replicas``.
- Scale down slowly: to the highest recommendation over the last ``scale_down_window_s``, so a
  dip between bursts does not remove capacity the next burst needs (as Kubernetes' HPA does).
- Scale to zero after ``idle_to_zero_s`` without requests (when ``min_replicas`` is 0); the
  first request after that brings one replica back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int = 0
    max_replicas: int = 4
    # Requests queued or running per replica that one replica serves within its SLO.
    target_load_per_replica: float = 8.0
    slo_p99_ms: float | None = None
    scale_down_window_s: float = 120.0
    idle_to_zero_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 0 <= min_replicas <= max_replicas")
        if self.target_load_per_replica <= 0:
            raise ValueError("target_load_per_replica must be positive")


@dataclass(frozen=True)
class Signal:
    """One observation of a deployment, summed over its replicas' heartbeats."""

    at: float  # seconds (any monotonic origin)
    replicas: int  # replicas running now
    queue_depth: float  # requests waiting in the agents' batchers
    in_flight: float  # requests being run
    p99_ms: float  # the worst replica's p99 over the heartbeat window
    requests: int  # requests served since the previous signal
    pending: int = 0  # requests held at the gateway for a version with no ready replica


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    inputs: dict[str, Any]  # what the decision saw, stored with it


def recommend(policy: ScalingPolicy, signal: Signal) -> tuple[int, str]:
    """Replicas the latest signal alone asks for, and why."""
    load = signal.queue_depth + signal.in_flight + signal.pending
    by_load = math.ceil(load / policy.target_load_per_replica)
    reason = f"load {load:g} at {policy.target_load_per_replica:g} per replica → {by_load}"
    if policy.slo_p99_ms and signal.replicas and signal.p99_ms > policy.slo_p99_ms:
        # The tail is past the SLO although the load looks served: one more replica per
        # decision. Not in proportion to the p99: a backlog inflates it long after the load
        # rule has already added the replicas that drain it.
        if by_load <= signal.replicas:
            by_load = signal.replicas + 1
            slo = policy.slo_p99_ms
            reason = f"p99 {signal.p99_ms:g} ms over the {slo:g} ms SLO → {by_load}"
    if by_load == 0 and (signal.requests or signal.pending):
        by_load, reason = 1, "traffic with no load left over → 1"
    return by_load, reason


def decide(policy: ScalingPolicy, history: Sequence[Signal], idle_since: float | None) -> Decision:
    """The replicas to run now, from the signals so far (oldest first; the last is now).

    ``idle_since`` is when the deployment last served or held a request (None: never).
    """
    latest = history[-1]
    now = latest.at
    wanted, reason = recommend(policy, latest)
    inputs = asdict(latest) | {"recommended": wanted}
    current = latest.replicas
    if wanted > current:
        # At most double (or +4) per decision, as the HPA does: the signals of a replica that
        # is still starting lag, and a noisy p99 must not send the fleet to its maximum.
        step_limit = max(current * 2, current + 4)
        desired = min(wanted, policy.max_replicas, step_limit)
        if desired < wanted:
            reason += f", capped at {desired}"
        return Decision(max(desired, policy.min_replicas), f"up: {reason}", inputs)
    # Down (or hold): the highest recommendation over the stabilisation window.
    window = [s for s in history if now - s.at <= policy.scale_down_window_s]
    highest = max(recommend(policy, s)[0] for s in window)
    desired = max(min(highest, policy.max_replicas), policy.min_replicas)
    idle_for = now - idle_since if idle_since is not None else math.inf
    if desired == 0 and current > 0 and idle_for < policy.idle_to_zero_s:
        # Idle, but not for long enough to scale to zero: keep one warm replica.
        desired = 1
        reason = f"idle {idle_for:.0f} s of {policy.idle_to_zero_s:g} s before scaling to zero"
    elif desired < current:
        reason = f"down: highest need over {policy.scale_down_window_s:g} s is {highest}"
    elif desired == current:
        reason = f"hold: {reason}"
    else:
        reason = f"up to the floor: min {policy.min_replicas}"
    inputs |= {"window_highest": highest, "idle_s": None if idle_since is None else idle_for}
    return Decision(desired, reason, inputs)
