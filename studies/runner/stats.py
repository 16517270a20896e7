"""The study's statistics: exact intervals for success counts and exact seed-paired tests.

With few seeds (5 per cell) nothing here is asymptotic: the interval is Clopper-Pearson's and the
paired test enumerates every sign pattern. Note what 5 seeds can say: the smallest two-sided
p-value of a paired test over 5 pairs is 2 / 2^5 = 0.0625, so no seed-paired comparison of two
cells can reach p < 0.05 however large the gap. Success counts are compared with Fisher's exact
test as well (5 of 5 against 0 of 5 gives p = 0.008).
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy import stats


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval for a success probability after ``k`` successes in ``n`` trials (scipy's)."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"k={k}, n={n} is not allowed: expected 0 <= k <= n and n >= 1")
    interval = stats.binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
    return float(interval.low), float(interval.high)


def paired_permutation_p(a: list[float], b: list[float]) -> float:
    """Two-sided exact p-value of the seed-paired permutation test of ``mean(a - b) = 0``.

    Under the null hypothesis each paired difference is as likely positive as negative; the
    p-value is the share of the ``2^n`` sign patterns whose mean difference is at least as far
    from zero as the observed one.
    """
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if len(d) != len(b) or len(d) == 0:
        raise ValueError(f"expected two non-empty lists of the same length (paired by seed), got {len(a)} and {len(b)}")
    observed = abs(d.sum())
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))  # (2^n, n)
    return float(np.mean(np.abs(signs @ d) >= observed - 1e-12))


def sign_test_p(a: list[float], b: list[float]) -> float:
    """Two-sided exact sign test on the paired differences (ties dropped); 1.0 if all are ties."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    if wins + losses == 0:
        return 1.0
    return float(stats.binomtest(wins, wins + losses, 0.5).pvalue)


def fisher_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided Fisher exact test of two success counts ``k1/n1`` and ``k2/n2``."""
    return float(stats.fisher_exact([[k1, n1 - k1], [k2, n2 - k2]]).pvalue)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (Holm 1979), in the order given.

    The i-th smallest of m p-values is multiplied by ``m - i`` (i from 0), then made non-decreasing
    along that order and capped at 1: rejecting where the adjusted value is below alpha keeps the
    family-wise error rate at alpha, for any dependence between the tests. (statsmodels'
    ``multipletests(method="holm")`` computes the same; it is not a dependency here.)
    """
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order])
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(stepped, 1.0)
    return adjusted.tolist()
