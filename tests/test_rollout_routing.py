"""Sticky, reproducible arm assignment and the strategies behind it."""

import pytest

from rollouts.routing import BUCKETS, Split, bucket
from rollouts.strategies import Arm


def split(weights: dict[str, float], plan_id: int = 7, shadow=None) -> Split:
    arms = tuple(Arm(name, i + 1, w) for i, (name, w) in enumerate(weights.items()))
    total, bounds, running = sum(weights.values()), [], 0.0
    for arm in arms:
        running += arm.weight
        bounds.append(round(running / total * BUCKETS))
    return Split(plan_id, arms, tuple(bounds), "x-user-id", shadow)


def test_the_same_key_always_gets_the_same_arm():
    s = split({"baseline": 90, "candidate": 10})
    assert all(s.choose(f"user-{i}") == s.choose(f"user-{i}") for i in range(1000))
    assert bucket(7, "user-1") == bucket(7, "user-1")


@pytest.mark.parametrize("weight", [1, 5, 25, 50])
def test_split_over_10000_keys_is_within_one_point_of_the_weight(weight):
    s = split({"baseline": 100 - weight, "candidate": weight})
    share = sum(s.choose(f"user-{i}").name == "candidate" for i in range(10_000)) / 100
    assert abs(share - weight) <= 1.0


def test_three_arm_ab_split_follows_the_weights():
    s = split({"a": 50, "b": 30, "c": 20})
    counts = {"a": 0, "b": 0, "c": 0}
    for i in range(10_000):
        counts[s.choose(f"k{i}").name] += 1
    assert abs(counts["a"] / 100 - 50) <= 1.5
    assert abs(counts["b"] / 100 - 30) <= 1.5
    assert abs(counts["c"] / 100 - 20) <= 1.5


def test_different_plans_reshuffle_keys_independently():
    one, two = split({"b": 50, "c": 50}, plan_id=1), split({"b": 50, "c": 50}, plan_id=2)
    same = sum(one.choose(f"k{i}").name == two.choose(f"k{i}").name for i in range(2000))
    assert 800 < same < 1200  # about half: no correlation between plans


def test_shadow_sample_share_is_respected():
    s = split({"baseline": 100}, shadow=(9, 0.25))
    copied = sum(s.shadow_for(f"k{i}") == 9 for i in range(10_000))
    assert abs(copied / 100 - 25) <= 1.5
    assert split({"baseline": 100}).shadow_for("k") is None
