"""Paired statistics for the evaluation: McNemar's exact test (a two-sided binomial test on the discordant
pairs, `scipy.stats.binomtest`), a perplexity from summed negative log-likelihoods, and the confidence interval
of a paired perplexity change."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict[str, Any]:
    """McNemar's exact test of paired binary outcomes a[i], b[i] (e.g. correct with cache A / with cache B).

    b01 = #(a wrong, b right), b10 = #(a right, b wrong). Under H0 (same accuracy) each discordant pair is
    a fair coin: p = two-sided binomtest(b10, b01 + b10, 0.5); p = 1 when there are no discordant pairs.
    """
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need equal lengths, got {len(a)} and {len(b)}")
    b10 = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    b01 = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    n = b01 + b10
    if n == 0:
        p = 1.0
    else:
        from scipy.stats import binomtest

        p = float(binomtest(b10, n, 0.5, alternative="two-sided").pvalue)
    return {"n": len(a), "a_only": b10, "b_only": b01, "discordant": n, "p_value": p}


def perplexity(nll_sum: float, count: int) -> float:
    """exp(mean negative log-likelihood in nats)."""
    if count <= 0:
        raise ValueError("perplexity of zero tokens")
    return math.exp(nll_sum / count)


def paired_ppl_delta(nll: Sequence[np.ndarray], base: Sequence[np.ndarray], z: float = 1.959964) -> dict[str, Any]:
    """The perplexity change of `nll` vs `base` (per-window arrays of per-token NLLs on the same tokens) with
    95 % confidence intervals: ppl ratio = exp(mean_t (nll_t - base_t)), so delta% = 100 (exp(D) - 1) with D the
    mean paired difference. Two standard errors of D:

      token:  sd(d_t) / sqrt(n)              (treats tokens as independent: optimistic where they correlate)
      window: the cluster-robust one, sqrt(sum_w (S_w - n_w D)^2) / n with S_w the window's sum of d_t
              (honest about correlation within a window; unstable with few windows)

    The reported interval uses the larger of the two."""
    if len(nll) != len(base) or not nll:
        raise ValueError("paired NLLs need the same, non-zero number of windows")
    diffs = [np.asarray(a, np.float64) - np.asarray(b, np.float64) for a, b in zip(nll, base, strict=True)]
    d = np.concatenate(diffs)
    n = d.size
    mean = float(d.mean())
    se_token = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    se_window = float(math.sqrt(sum((x.sum() - x.size * mean) ** 2 for x in diffs)) / n) if len(diffs) > 1 \
        else math.inf
    se = max(se_token, se_window)

    def pct(x: float) -> float:
        return 100.0 * math.expm1(x)

    return {"delta_percent": pct(mean), "ci95_percent": [pct(mean - z * se), pct(mean + z * se)],
            "se_token_nats": se_token, "se_window_nats": se_window, "tokens": n, "windows": len(diffs),
            "per_window_delta_percent": [pct(float(x.mean())) for x in diffs]}
