"""scripts/eval_summary_from_parts.py: NIAH needles of several runs pooled into one paired comparison."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from eval_summary_from_parts import pooled_niah  # noqa: E402

from certattn_jax.evals.stats import mcnemar_exact  # noqa: E402


def _part(rng, n, p_dense, flip):
    """n needles: dense right with probability p_dense; naive flips dense's outcome with probability flip."""
    out = []
    for _ in range(n):
        d = bool(rng.random() < p_dense)
        out.append({"dense": {"correct": d}, "certified": {"correct": d},
                    "naive": {"correct": d != bool(rng.random() < flip)}})
    return {"niah": {"samples": out}}


def test_needles_of_every_part_are_pooled_into_one_paired_test():
    rng = np.random.default_rng(3)
    parts = {"a.json": _part(rng, 40, 0.9, 0.3), "b.json": _part(rng, 50, 0.7, 0.3)}
    got = pooled_niah(parts)
    every = parts["a.json"]["niah"]["samples"] + parts["b.json"]["niah"]["samples"]
    assert got["n"] == 90
    for mode in ("dense", "naive", "certified"):
        assert got[mode] == pytest.approx(np.mean([x[mode]["correct"] for x in every]))
    want = mcnemar_exact([x["dense"]["correct"] for x in every], [x["naive"]["correct"] for x in every])
    assert want["discordant"] > 0 and got["mcnemar_p_naive_vs_dense"] == want["p_value"]
    assert got["mcnemar_p_certified_vs_dense"] == 1.0  # identical outcomes: no discordant pair
