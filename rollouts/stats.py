"""The guardrails' statistics: tests that stay honest when they are re-run every few seconds on
data that keeps growing.

- Error rates: a mixture sequential probability ratio test (mSPRT, Johari, Pekelis and Walsh,
  "Always valid inference", 2017) on the difference of two proportions. Its p-value is valid at
  every look at once, so re-running it every 5 s keeps the false-alarm rate under ``alpha``
  however many looks there are (a fixed-sample z-test re-run 100 times does not).
- Quantiles (p99): distribution-free order-statistic confidence bounds (the rank of the bound
  comes from the binomial distribution) read from the fine latency histogram.
- Egregious failure: exact (Clopper-Pearson) bounds on a proportion at a tiny alpha.

Pure numpy/scipy; the functions take counts, so a simulation can call them directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from monitoring.traffic import fine_lower_ms

# The mixing distribution's standard deviation, in rate points: the size of an excess over the
# allowed increase the test is most sensitive to. Johari et al. pick it from past effect sizes;
# 5 points still catches 1-point excesses with a few thousand requests and does not lose power
# on large differences seen early (an A/B arm 30 points more accurate on 150 labelled rows).
MIXTURE_SD = 0.05


def msprt_log_lr(diff: np.ndarray | float, var: np.ndarray | float, tau2: float) -> np.ndarray:
    """log of the normal-mixture likelihood ratio for an estimated difference ``diff`` with
    variance ``var`` against a mixture N(0, tau2) of alternatives (works on arrays)."""
    diff, var = np.asarray(diff, dtype=float), np.asarray(var, dtype=float)
    return 0.5 * np.log(var / (var + tau2)) + tau2 * diff**2 / (2 * var * (var + tau2))


def _rate_and_variance(errors: np.ndarray | int, requests: np.ndarray | int) -> tuple[Any, ...]:
    errors, requests = np.asarray(errors, dtype=float), np.asarray(requests, dtype=float)
    rate = errors / np.maximum(requests, 1)
    # Half a pseudo-error keeps the variance above zero while an arm has no errors yet.
    smoothed = (errors + 0.5) / (requests + 1)
    return rate, smoothed * (1 - smoothed) / np.maximum(requests, 1)


def excess_p_values(
    base_errors: np.ndarray | int,
    base_requests: np.ndarray | int,
    cand_errors: np.ndarray | int,
    cand_requests: np.ndarray | int,
    allowed: float,
    tau: float = MIXTURE_SD,
) -> np.ndarray:
    """Always-valid p-values of "the candidate's error rate exceeds the baseline's by more than
    ``allowed``" (1 where the estimate is not above ``allowed``: one-sided). Arrays in, arrays
    out, so a simulation of many runs and looks is one call."""
    base_rate, base_var = _rate_and_variance(base_errors, base_requests)
    cand_rate, cand_var = _rate_and_variance(cand_errors, cand_requests)
    diff = cand_rate - base_rate - allowed
    log_lr = msprt_log_lr(diff, base_var + cand_var, tau * tau)
    p = np.minimum(1.0, np.exp(-log_lr))
    return np.where(diff > 0, p, 1.0)


@dataclass(frozen=True)
class ErrorTest:
    base_rate: float
    cand_rate: float
    p_value: float
    alpha: float

    @property
    def significant(self) -> bool:
        return self.p_value < self.alpha


def error_excess(
    base: tuple[int, int], cand: tuple[int, int], allowed: float, alpha: float
) -> ErrorTest:
    """The sequential test for (errors, requests) of two arms."""
    p = float(excess_p_values(base[0], base[1], cand[0], cand[1], allowed))
    return ErrorTest(base[0] / max(base[1], 1), cand[0] / max(cand[1], 1), p, alpha)


# Exact bounds on a proportion -----------------------------------------------------------------


def proportion_lower(successes: int, trials: int, alpha: float) -> float:
    """One-sided Clopper-Pearson lower bound: the true proportion is above it with 1 - alpha."""
    if successes <= 0 or trials <= 0:
        return 0.0
    from scipy.stats import beta  # ~0.5 s to import, in every process that loads the admin

    return float(beta.ppf(alpha, successes, trials - successes + 1))


def proportion_upper(successes: int, trials: int, alpha: float) -> float:
    """One-sided Clopper-Pearson upper bound."""
    if trials <= 0:
        return 1.0
    if successes >= trials:
        return 1.0
    from scipy.stats import beta  # see proportion_lower

    return float(beta.ppf(1 - alpha, successes + 1, trials - successes))


# Quantile bounds from the fine histogram --------------------------------------------------------


@dataclass(frozen=True)
class QuantileBounds:
    lower_ms: float  # 0 when too few samples to bound it from below
    upper_ms: float  # infinity when too few samples to bound it from above
    samples: int


def quantile_bounds(fine: Mapping[int, int], q: float, alpha: float) -> QuantileBounds:
    """Distribution-free one-sided bounds, each holding with 1 - alpha, on the q-quantile.

    With n samples, the k-th smallest lies below the q-quantile with probability
    P(Binomial(n, q) >= k): the lower bound is the largest such order statistic that is below
    it with 1 - alpha, the upper bound the smallest one above it with 1 - alpha. A histogram
    knows an order statistic only up to its bucket, so the lower bound takes the bucket's lower
    edge and the upper bound its upper edge (at most one bucket, about 5 %, conservative).
    """
    n = sum(fine.values())
    if n == 0:
        return QuantileBounds(0.0, math.inf, 0)
    from scipy.stats import binom  # see proportion_lower

    low_rank = int(binom.ppf(alpha, n, q))  # P(Bin <= low_rank - 1) < alpha
    high_rank = int(binom.ppf(1 - alpha, n, q)) + 1  # P(Bin <= high_rank - 1) >= 1 - alpha
    lower, upper = 0.0, math.inf
    running = 0
    for index in sorted(fine):
        before = running
        running += fine[index]
        if low_rank >= 1 and before < low_rank <= running:
            lower = fine_lower_ms(index)
        if high_rank <= n and before < high_rank <= running:
            upper = fine_lower_ms(index + 1)
            break
    return QuantileBounds(lower, upper, n)
