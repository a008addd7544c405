"""The statistics behind bench, eval and verify: plain functions of numbers, no models.

- summaries of repeated timings (median, mean, std),
- the Wilson score interval of a proportion and the two-proportion z-test,
- the expected speedup of speculative decoding (Leviathan et al. 2023, Theorem 3.8 and Corollary 3.9), in its
  original form (the verification costs one target step) and refined with a measured verification cost,
- goodness of fit of samples to an exact distribution: total-variation distance, a chi-square test with pooling
  of small cells, and a sample-size-aware bound on the total-variation distance under the null hypothesis,
- the counters of several generate() calls merged into one Stats.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist
from typing import Hashable, Iterable, Mapping, Sequence

import numpy as np


# --------------------------------------------------------------------------- summaries
def summarize(values: Sequence[float]) -> dict:
    """median, mean, sample std (0 for a single value), min, max and n of a list of numbers."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {"n": 0, "median": float("nan"), "mean": float("nan"), "std": float("nan"),
                "min": float("nan"), "max": float("nan")}
    return {"n": int(arr.size), "median": float(np.median(arr)), "mean": float(arr.mean()),
            "std": float(arr.std(ddof=1)) if arr.size > 1 else 0.0, "min": float(arr.min()),
            "max": float(arr.max())}


# --------------------------------------------------------------------------- counters
MAX_FIELDS = ("num_speculative_tokens", "copy_limit")  # fields of results.Stats that are a bound, not a count
LAST_FIELDS = ("policy", "policy_summary")  # a label, and a report of the policy's state at the end of a call


def merge_stats(items: Iterable):
    """The results.Stats of several generate() calls as one.

    Counts and times add up (per-position lists element by element, dicts of counts key by key); a bound (the
    largest K) is the largest; a label or a report of the state at the end (the policy's) is the last call's.
    """
    from ..engine.results import Stats

    items = list(items)
    total = Stats()
    if items:
        for f in dataclasses.fields(Stats):
            setattr(total, f.name, _merge_field(f.name, [getattr(s, f.name) for s in items]))
    return total


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _merge_field(name: str, values: list):
    if name in MAX_FIELDS:
        return max(values)
    if name in LAST_FIELDS:
        return values[-1]
    if all(_is_number(v) for v in values):
        return sum(values)
    if all(isinstance(v, list) for v in values):
        width = max(map(len, values))
        return [sum(v[i] for v in values if i < len(v)) for i in range(width)]
    if all(isinstance(v, dict) and all(_is_number(x) for x in v.values()) for v in values):
        merged: dict = {}
        for v in values:
            for key, x in v.items():
                merged[key] = merged.get(key, 0) + x
        return merged
    return values[-1]


# --------------------------------------------------------------------------- proportions
def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (what statsmodels calls method='wilson').

    center = (p̂ + z²/2n) / (1 + z²/n), half-width = z √(p̂(1−p̂)/n + z²/4n²) / (1 + z²/n). (0, 1) when n = 0.
    """
    if n < 0 or successes < 0 or successes > n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, center - half)  # exact at the ends, not 1e-17 off
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def two_proportion_ztest(x1: int, n1: int, x2: int, n2: int) -> tuple[float, float]:
    """Two-sided z-test of H0: p1 = p2 with the pooled variance. Returns (z, p-value).

    When both samples are all successes or all failures the variance is 0 and there is no evidence of a
    difference: (0.0, 1.0).
    """
    if n1 <= 0 or n2 <= 0:
        raise ValueError("both samples need n > 0")
    p1, p2 = x1 / n1, x2 / n2
    pooled = (x1 + x2) / (n1 + n2)
    var = pooled * (1 - pooled) * (1 / n1 + 1 / n2)
    if var <= 0:
        return 0.0, 1.0
    z = (p1 - p2) / math.sqrt(var)
    return z, 2.0 * (1.0 - NormalDist().cdf(abs(z)))


# --------------------------------------------------------------------------- speculative decoding theory
def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens emitted per target verification] = (1 − α^(K+1)) / (1 − α) (K+1 when α = 1)."""
    _check_alpha_k(alpha, k)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Expected speedup over plain decoding: (1 − α^(K+1)) / ((1 − α)(K c + v)).

    alpha: the probability that a draft token is accepted (Leviathan's α = E[β]); k: drafts per step;
    c: cost of one draft step / one target step; v: cost of the (K+1)-token verification / one target step.
    v = 1 is Leviathan et al.'s formula, which assumes the verification costs one plain step.
    """
    if c < 0 or v <= 0:
        raise ValueError(f"need c >= 0 and v > 0, got c={c}, v={v}")
    return expected_tokens_per_step(alpha, k) / (k * c + v)


def solve_alpha(tokens_per_step: float, k: int) -> float:
    """The α for which (1 − α^(K+1)) / (1 − α) equals a measured number of tokens per step (bisection)."""
    if k < 1:
        raise ValueError("k must be >= 1")
    if tokens_per_step <= 1.0:
        return 0.0
    if tokens_per_step >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, k) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _check_alpha_k(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")


# --------------------------------------------------------------------------- goodness of fit
def tv_distance(p: Mapping[Hashable, float] | Sequence[float], q: Mapping[Hashable, float] | Sequence[float]) -> float:
    """Total-variation distance ½ Σ |p − q| between two distributions (dicts over any keys, or aligned arrays)."""
    if isinstance(p, Mapping) or isinstance(q, Mapping):
        keys = set(p) | set(q)
        return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)
    a, b = np.asarray(p, dtype=float), np.asarray(q, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"distributions of different shapes: {a.shape} and {b.shape}")
    return float(0.5 * np.abs(a - b).sum())


def tv_threshold(probs: Iterable[float], n: int, delta: float) -> float:
    """A level-δ bound on the TV distance between the empirical distribution of n i.i.d. samples and the true one.

    E[TV] ≤ ½ Σ √(pᵢ(1−pᵢ)/n) (Jensen on each cell), and TV moves by at most 1/n when one sample changes, so by
    McDiarmid's inequality P(TV > E[TV] + √(ln(1/δ) / 2n)) ≤ δ. Under the null hypothesis (the sampler is exact),
    the empirical TV exceeds this threshold with probability at most δ.
    """
    if n <= 0:
        raise ValueError("n must be > 0")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    expected = 0.5 * sum(math.sqrt(max(p, 0.0) * max(1.0 - p, 0.0) / n) for p in probs)
    return expected + math.sqrt(math.log(1.0 / delta) / (2.0 * n))


def pool_small_cells(observed: Sequence[int], expected: Sequence[float],
                     min_expected: float = 5.0) -> tuple[list[int], list[float]]:
    """Merge every cell with expected count < min_expected into one pooled cell (the usual chi-square rule).

    If the pooled cell is itself still below min_expected, it is merged into the smallest remaining cell.
    """
    if len(observed) != len(expected):
        raise ValueError("observed and expected have different lengths")
    big = [(o, e) for o, e in zip(observed, expected) if e >= min_expected]
    small_o = sum(o for o, e in zip(observed, expected) if e < min_expected)
    small_e = sum(e for e in expected if e < min_expected)
    obs, exp = [o for o, _ in big], [e for _, e in big]
    if small_e > 0 or small_o > 0:
        if small_e >= min_expected or not obs:
            obs.append(small_o)
            exp.append(small_e)
        else:
            i = int(np.argmin(exp))
            obs[i] += small_o
            exp[i] += small_e
    return obs, exp


def chisquare_gof(observed: Sequence[int], probs: Sequence[float], min_expected: float = 5.0) -> dict:
    """Chi-square goodness of fit of counts to exact cell probabilities (which must sum to 1), after pooling.

    Returns {"statistic", "dof", "p_value", "cells"}; with fewer than two cells left there is nothing to test
    and p_value is 1.0. An observation in a cell of expected count below 1e-3 (an outcome of essentially zero
    probability) gives p_value 0.0: the chi-square approximation says nothing there, but such a sample alone is
    evidence at a level far below any usual threshold.
    """
    from scipy.stats import chisquare

    observed = [int(o) for o in observed]
    n = sum(observed)
    total = float(sum(probs))
    if n == 0:
        raise ValueError("no observations")
    if abs(total - 1.0) > 1e-4:
        raise ValueError(f"cell probabilities sum to {total}, not 1")
    expected = [n * p / total for p in probs]
    impossible = sum(o for o, e in zip(observed, expected) if e < 1e-3 and o > 0)
    obs, exp = pool_small_cells(observed, expected, min_expected)
    if impossible:
        return {"statistic": float("inf"), "dof": max(len(obs) - 1, 0), "p_value": 0.0, "cells": len(obs),
                "impossible_samples": impossible}
    if len(obs) < 2:
        return {"statistic": 0.0, "dof": 0, "p_value": 1.0, "cells": len(obs), "impossible_samples": 0}
    exp_arr = np.asarray(exp, dtype=float)
    exp_arr *= n / exp_arr.sum()  # scipy insists on equal sums to a tight tolerance
    result = chisquare(np.asarray(obs, dtype=float), exp_arr)
    return {"statistic": float(result.statistic), "dof": len(obs) - 1, "p_value": float(result.pvalue),
            "cells": len(obs), "impossible_samples": 0}
