"""Perplexity on windows of big.txt's prose (the PG-19 stand-in), dense vs naive vs certified on identical
windows: prefill the first `length - 1 - steps` tokens (exact in every mode), then teacher-force the rest one
decode step at a time and score the last `steps` tokens, so the perplexity is that of the cache under test.
The window positions are drawn by a seeded generator from the whole corpus (all four books)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from certattn_jax.evals import data, stats
from certattn_jax.evals.session import Mode, Session


def windows(tokenizer: Any, length: int, count: int, seed: int = 0, text: str | None = None) -> list[list[int]]:
    """`count` windows of exactly `length` token ids from random places of the prose (seeded)."""
    text = data.prose() if text is None else text
    span = 8 * length  # characters: ~4 per token in English prose, with room to spare
    if len(text) < span + 1:
        raise ValueError(f"the corpus ({len(text)} characters) is too short for {length}-token windows")
    rng = np.random.default_rng([seed, length])
    out = []
    for start in rng.integers(0, len(text) - span, size=count):
        piece = text[start:start + span]
        piece = piece[piece.find(" ") + 1:]  # start on a word boundary
        ids = tokenizer.encode(piece)
        if len(ids) < length:
            raise ValueError(f"a window of {span} characters gave only {len(ids)} tokens (< {length})")
        out.append(ids[:length])
    return out


def run_ppl(session: Session, modes: Sequence[Mode], lengths: Sequence[int], samples: int, steps: int,
            seed: int = 0) -> dict[str, Any]:
    """Per length and mode: perplexity over all measured tokens of all windows, per-window perplexities, top-1
    agreement with dense, and the relative change vs dense with its paired 95 % confidence interval
    (`stats.paired_ppl_delta`). Returns a JSON-ready dict."""
    result: dict[str, Any] = {"lengths": list(lengths), "samples": samples, "decode_steps": steps, "per_length": {}}
    total = len(lengths) * samples * len(modes)
    bar = tqdm(total=total, desc="ppl", unit="run")
    for n in lengths:
        if not 0 < steps < n - 1:
            raise ValueError(f"--ppl-steps {steps} must be in [1, {n - 2}] for {n}-token windows")
        wins = windows(session.tokenizer, n, samples, seed)
        row: dict[str, Any] = {}
        preds: dict[str, list[np.ndarray]] = {}
        for mode in modes:
            nlls, oks = [], []
            for w in wins:
                nll, ok = session.nll(mode, w, n - 1 - steps)
                nlls.append(nll)
                oks.append(ok)
                bar.update(1)
            allnll = np.concatenate(nlls)
            row[mode.label] = {
                "ppl": stats.perplexity(float(allnll.sum()), allnll.size),
                "per_window_ppl": [stats.perplexity(float(x.sum()), x.size) for x in nlls],
                "top1_accuracy": float(np.concatenate(oks).mean()),
                "tokens": int(allnll.size),
            }
            preds[mode.label] = nlls
        if "dense" in row:
            base = row["dense"]["ppl"]
            for label, r in row.items():
                r["delta_vs_dense_percent"] = 100.0 * (r["ppl"] - base) / base
                r["max_abs_nll_diff_vs_dense"] = float(max(np.max(np.abs(a - b)) for a, b in
                                                           zip(preds[label], preds["dense"], strict=True)))
                if label != "dense":
                    r["paired_vs_dense"] = stats.paired_ppl_delta(preds[label], preds["dense"])
        result["per_length"][str(n)] = row
    bar.close()
    return result
