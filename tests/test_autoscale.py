"""The autoscaler's decision on recorded signal series: rises under load, holds through the
stabilisation window, never exceeds max, reaches zero when idle, comes back on a request."""

from __future__ import annotations

import pytest

from fleet.autoscale import ScalingPolicy, Signal, decide

POLICY = ScalingPolicy(
    min_replicas=0,
    max_replicas=5,
    target_load_per_replica=8,
    slo_p99_ms=100,
    scale_down_window_s=60,
    idle_to_zero_s=120,
)


def replay(series: list[dict], policy: ScalingPolicy = POLICY, start: int = 1) -> list[int]:
    """Run the decision every 15 s over a series of (load, p99, requests), applying each
    decision at once; returns the replicas after each step."""
    history: list[Signal] = []
    replicas, idle_since, out = start, 0.0, []
    for step, point in enumerate(series):
        at = step * 15.0
        if point.get("requests", 1) or point.get("pending", 0):
            idle_since = at
        history.append(
            Signal(
                at=at,
                replicas=replicas,
                queue_depth=point.get("queue", 0),
                in_flight=point.get("in_flight", 0),
                p99_ms=point.get("p99", 10),
                requests=point.get("requests", 1),
                pending=point.get("pending", 0),
            )
        )
        replicas = decide(policy, history, idle_since).desired
        out.append(replicas)
    return out


def test_rises_under_load_at_once():
    steps = replay([{"queue": 2, "in_flight": 4}, {"queue": 20, "in_flight": 8}])
    assert steps == [1, 4]  # 28 waiting or running at 8 per replica


def test_a_slow_tail_adds_a_replica_per_decision():
    # Little queued, but p99 over the SLO on 2 replicas: one more each time until it is not.
    slow = [{"in_flight": 8, "p99": 200}] * 2
    assert replay(slow + [{"in_flight": 8, "p99": 60}], start=2) == [3, 4, 4]


def test_never_exceeds_max():
    assert replay([{"queue": 500, "in_flight": 40, "p99": 900}] * 3) == [5, 5, 5]


def test_holds_through_the_stabilisation_window_then_steps_down():
    burst = [{"queue": 30, "in_flight": 10}]  # 40 → 5 replicas
    quiet = [{"in_flight": 4}] * 8  # 4 → 1 replica, 2 minutes of it
    steps = replay(burst + quiet)
    assert steps[0] == 5
    # 60 s window at 15 s steps: the burst still counts for 4 more decisions.
    assert steps[1:5] == [5, 5, 5, 5]
    assert steps[5:] == [1, 1, 1, 1]


def test_flapping_load_does_not_flap_replicas():
    wave = [{"queue": 24, "in_flight": 8}, {"in_flight": 2}] * 6  # 4 ↔ 1 every 15 s
    steps = replay(wave)
    assert steps[0] == 4 and set(steps[1:]) == {4}


def test_reaches_zero_only_after_the_idle_time_and_comes_back_on_a_request():
    idle = [{"requests": 0}] * 10  # 150 s without a request
    steps = replay([{"in_flight": 3}] + idle + [{"requests": 0, "pending": 1}])
    # Idle under 120 s keeps one warm replica; past it, zero; a held request brings one back.
    assert steps[:8] == [1] * 8
    assert steps[8:11] == [0, 0, 0]
    assert steps[11] == 1


def test_min_replicas_is_a_floor():
    policy = ScalingPolicy(min_replicas=2, max_replicas=4, scale_down_window_s=0)
    assert replay([{"requests": 0}] * 3, policy) == [2, 2, 2]


def test_every_decision_says_why_and_keeps_its_inputs():
    history = [Signal(0, 2, 50, 10, 50, 100)]
    decision = decide(POLICY, history, idle_since=0)
    assert decision.desired == 5 and decision.reason.startswith("up: load 60")
    assert "capped at 5" in decision.reason
    assert decision.inputs["queue_depth"] == 50 and decision.inputs["recommended"] == 8


def test_a_bad_policy_is_refused():
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingPolicy(min_replicas=3, max_replicas=2)
