"""Replay a bursty traffic trace through the autoscaler's decision function
(``fleet.autoscale.decide``) with a model of replica start time and capacity, and compare it
with a fixed fleet sized for the peak: replicas over time, share of requests over the latency
SLO, and replica-minutes spent. Run: ``.venv/bin/python bench/autoscale_sim.py``.

The model, per second of the trace:
- traffic: a base rate that drifts between 20 and 60 requests/s over an hour, with 2-3x bursts
  of 3-8 minutes that ramp up over 1-2 minutes (seeded, so every run replays the same trace);
- a replica serves ``--capacity`` requests/s; requests spread over ready replicas, each an
  M/M/1 queue, so a request's time in the system is exponential with rate (mu - lambda) and
  P(latency > SLO) = exp(-(mu - lambda) * SLO); past capacity a backlog builds and drains;
- each replica's agent queues at most 64 requests; past that a request is refused (503);
- a new replica is ready ``--start-s`` seconds after the decision to add it; the autoscaler
  decides every ``--interval-s`` seconds from the signals an agent would report (requests
  queued and running by Little's law, the p99, requests served).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleet.autoscale import ScalingPolicy, Signal, decide  # noqa: E402


def trace(seconds: int, seed: int) -> list[float]:
    """Requests per second for each second of the trace."""
    rng = random.Random(seed)
    bursts = []
    t = rng.uniform(300, 600)
    while t < seconds:
        ramp, hold = rng.uniform(60, 120), rng.uniform(180, 480)
        bursts.append((t, ramp, hold, rng.uniform(2.0, 3.0)))
        t += ramp + hold + rng.uniform(600, 1200)
    rates = []
    for s in range(seconds):
        base = 40 + 20 * math.sin(2 * math.pi * s / 3600)
        factor = 1.0
        for start, ramp, hold, peak in bursts:
            if start <= s < start + ramp:
                factor = max(factor, 1 + (peak - 1) * (s - start) / ramp)
            elif start + ramp <= s < start + ramp + hold:
                factor = max(factor, peak)
            elif start + ramp + hold <= s < start + 2 * ramp + hold:  # and back down
                factor = max(factor, peak - (peak - 1) * (s - start - ramp - hold) / ramp)
        rates.append(base * factor * rng.uniform(0.95, 1.05))
    return rates


@dataclass
class Fleet:
    ready: int
    starting: list[float] = field(default_factory=list)  # when each starting replica is ready
    backlog: float = 0.0


@dataclass
class Outcome:
    replicas: list[int]
    over_slo: float  # requests over the SLO
    total: float
    replica_seconds: float


def run(
    rates: list[float],
    capacity: float,
    slo_s: float,
    start_s: float,
    interval_s: int,
    policy: ScalingPolicy | None,
    fixed: int = 0,
    max_queue: int = 64,
) -> Outcome:
    """Simulate a fleet: autoscaled with ``policy``, or ``fixed`` replicas when it is None."""
    fleet = Fleet(ready=fixed if policy is None else max(1, policy.min_replicas))
    history: list[Signal] = []
    over = total = replica_s = 0.0
    served_since = 0.0
    idle_since = 0.0
    per_step: list[int] = []
    for now, rate in enumerate(rates):
        fleet.ready += sum(1 for at in fleet.starting if at <= now)
        fleet.starting = [at for at in fleet.starting if at > now]
        mu = capacity
        running = fleet.ready + len(fleet.starting)  # starting replicas cost too
        replica_s += running
        arrivals = rate
        if fleet.ready == 0:
            fleet.backlog += arrivals
            over += arrivals
            lam = math.inf
            sojourn = math.inf
        else:
            lam = rate / fleet.ready
            served = min(fleet.backlog + arrivals, fleet.ready * mu)
            # Agents bound their queues (``max_queue``): what does not fit is refused (503),
            # counted over the SLO below, and never waits.
            fleet.backlog = min(fleet.backlog + arrivals - served, fleet.ready * max_queue)
            if lam >= mu or fleet.backlog > 0:
                over += arrivals  # saturated: waits grow past any SLO
                sojourn = (fleet.backlog / (fleet.ready * mu)) + 1 / mu
            else:
                over += arrivals * math.exp(-(mu - lam) * slo_s)
                sojourn = 1 / (mu - lam)
        total += arrivals
        served_since += arrivals
        if arrivals > 0:
            idle_since = now
        per_step.append(fleet.ready)
        if policy is None or now % interval_s:
            continue
        in_system = rate * sojourn if math.isfinite(sojourn) else fleet.backlog
        p99_ms = 1000 * (4.6 * sojourn if math.isfinite(sojourn) else 60.0)
        history.append(
            Signal(
                at=float(now),
                replicas=fleet.ready,
                queue_depth=fleet.backlog,
                in_flight=in_system,
                p99_ms=p99_ms,
                requests=int(served_since),
            )
        )
        served_since = 0.0
        desired = decide(policy, history[-64:], float(idle_since)).desired
        current = fleet.ready + len(fleet.starting)
        if desired > current:
            fleet.starting += [now + start_s] * (desired - current)
        elif desired < current:
            drop = current - desired
            cancelled = min(drop, len(fleet.starting))  # stop starting ones first
            fleet.starting = fleet.starting[: len(fleet.starting) - cancelled]
            fleet.ready -= drop - cancelled
    return Outcome(per_step, over, total, replica_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hours", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--capacity", type=float, default=25.0, help="requests/s per replica")
    parser.add_argument("--slo-ms", type=float, default=1000.0)
    parser.add_argument("--start-s", type=float, default=30.0, help="replica start time")
    parser.add_argument("--interval-s", type=int, default=15, help="control loop interval")
    parser.add_argument("--target", type=float, default=1.2, help="load per replica")
    parser.add_argument("--window-s", type=float, default=60.0, help="scale-down window")
    args = parser.parse_args()

    rates = trace(int(args.hours * 3600), args.seed)
    slo_s = args.slo_ms / 1000
    # Peak provisioning: enough replicas that the peak second stays within the SLO at p99.
    need = max(rates) / (args.capacity - 4.6 / slo_s)
    peak_fleet = math.ceil(need)
    policy = ScalingPolicy(
        min_replicas=1,
        max_replicas=peak_fleet * 2,
        target_load_per_replica=args.target,
        slo_p99_ms=args.slo_ms,
        scale_down_window_s=args.window_s,
        idle_to_zero_s=600,
    )
    fixed = run(rates, args.capacity, slo_s, args.start_s, args.interval_s, None, peak_fleet)
    auto = run(rates, args.capacity, slo_s, args.start_s, args.interval_s, policy)

    print(
        f"Trace: {args.hours:g} h, {sum(rates):,.0f} requests, {min(rates):.0f}-{max(rates):.0f} "
        f"requests/s (seed {args.seed}); replica capacity {args.capacity:g}/s, SLO p99 "
        f"{args.slo_ms:g} ms, start {args.start_s:g} s, decision every {args.interval_s} s, "
        f"target load {args.target:g} per replica, scale-down window {args.window_s:g} s.\n"
    )
    print("Replicas over time (ready, every 10 minutes):\n")
    print("| minute | requests/s | peak-provisioned | autoscaled |")
    print("| --- | --- | --- | --- |")
    for minute in range(0, len(rates) // 60, 10):
        s = minute * 60
        print(f"| {minute} | {rates[s]:.0f} | {fixed.replicas[s]} | {auto.replicas[s]} |")
    print("\n| fleet | replica-minutes | requests over SLO | max replicas |")
    print("| --- | --- | --- | --- |")
    for name, o in (("peak-provisioned", fixed), ("autoscaled", auto)):
        print(
            f"| {name} | {o.replica_seconds / 60:,.0f} | {100 * o.over_slo / o.total:.2f} % | "
            f"{max(o.replicas)} |"
        )
    saved = 1 - auto.replica_seconds / fixed.replica_seconds
    print(f"\nAutoscaling spends {100 * saved:.0f} % fewer replica-minutes than peak provisioning.")


if __name__ == "__main__":
    main()
