"""scripts/eval_summary_from_parts.py: NIAH needles of several runs pooled into one paired comparison; RULER's
scores of runs at different lengths kept per length and averaged over them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from eval_summary_from_parts import combine, pooled_niah  # noqa: E402

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


def _ruler_part(length, scores):
    """A RULER run at one length: {task: {mode: score}}."""
    return {"model": "m", "device": "d", "command": f"ruler {length}",
            "ruler": {"lengths": [length], "scores": {t: {str(length): s} for t, s in scores.items()}}}


def test_ruler_runs_at_two_lengths_are_kept_per_length_and_averaged():
    parts = {"r4k.json": _ruler_part(4096, {"vt": {"dense": 100.0, "naive": 50.0, "certified": 100.0},
                                           "cwe": {"dense": 10.0, "naive": 6.0, "certified": 8.0}}),
             "r8k.json": _ruler_part(8192, {"vt": {"dense": 0.0, "naive": 0.0, "certified": 50.0},
                                           "cwe": {"dense": 30.0, "naive": 20.0, "certified": 30.0}})}
    got = combine(parts)
    assert got["ruler_lengths"] == [4096, 8192]
    assert got["ruler_by_length"]["4096"]["vt"] == {"dense": 100.0, "naive": 50.0, "certified": 100.0}
    assert got["ruler_by_length"]["8192"]["cwe"]["naive"] == 20.0
    assert got["ruler"]["vt"] == {"dense": 50.0, "naive": 25.0, "certified": 75.0}
    assert got["ruler"]["cwe"] == {"dense": 20.0, "naive": 13.0, "certified": 19.0}


def _ppl_part(modes, dense_windows, shift=0.0):
    """A perplexity run at 8K: {mode: ppl} with dense's per-window perplexities."""
    rows = {m: {"ppl": v + shift, "tokens": 768, **({"per_window_ppl": dense_windows} if m == "dense" else {})}
            for m, v in modes.items()}
    return {"model": "m", "device": "d", "command": "ppl", "job": "ppl",
            "ppl": {"lengths": [8192], "per_length": {"8192": rows}}}


def test_a_later_run_on_the_same_windows_adds_its_modes_and_other_windows_replace_them():
    w = [15.5, 16.0, 19.2]
    first = _ppl_part({"dense": 20.5545, "certified": 20.5434}, w)
    naive = _ppl_part({"dense": 20.55448, "naive": 20.5632}, [x * 1.005 for x in w])  # the same tokens
    got = combine({"a.json": first, "b.json": naive})
    assert got["ppl"] == {"dense": {"8192": 20.5545}, "certified": {"8192": 20.5434}, "naive": {"8192": 20.5632}}
    assert got["ppl_source"]["8192"] == ["a.json", "b.json"]
    other = _ppl_part({"dense": 20.56, "naive": 20.5}, w)  # another sample: replace every mode
    got = combine({"a.json": first, "b.json": naive, "c.json": other})
    assert got["ppl"] == {"dense": {"8192": 20.56}, "certified": {}, "naive": {"8192": 20.5}}
    assert got["ppl_source"]["8192"] == "c.json"
