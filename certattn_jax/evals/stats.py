"""Paired statistics for the evaluation: McNemar's exact test (a two-sided binomial test on the discordant
pairs, `scipy.stats.binomtest`) and a perplexity from summed negative log-likelihoods."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


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
