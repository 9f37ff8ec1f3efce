"""Needle in a haystack over a grid of context length x needle depth, several needles per cell, identical
prompts for every cache mode. The prompt is RULER's niah_single_2 (prose haystack, an adjective-noun key, a
7-digit value; `ruler.niah` with the depth fixed), greedy decoding, scored by RULER's string_match_all (a
needle is found when its value appears in the answer). Paired outcomes feed McNemar's exact test."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from certattn_jax.evals import plots, ruler, stats
from certattn_jax.evals.session import Mode, Session

TASK = "niah_single_2"


def grid_samples(count_tokens: Callable[[ruler.Sample], int], lengths: Sequence[int], depths: Sequence[int],
                 per_cell: int, max_new_tokens: int, seed: int = 0) -> dict[tuple[int, int], list[ruler.Sample]]:
    """{(length, depth): samples} fitted to each length. Sample i of a length has the same passage and needle
    at every depth (the seed does not depend on the depth): only the needle's position changes."""
    return {(n, d): ruler.generate_samples(TASK, n, per_cell, count_tokens, seed, max_new_tokens, depths=[d])
            for n in lengths for d in depths}


def run_niah(session: Session, modes: Sequence[Mode], prompt_ids: Callable[[ruler.Sample], list[int]],
             lengths: Sequence[int], depths: Sequence[int], per_cell: int, max_new_tokens: int,
             stop_ids: Sequence[int] = (), seed: int = 0, plot_dir: str | None = None,
             decode_text: Callable[[list[int]], str] = str) -> dict[str, Any]:
    """Accuracy per cell and mode, overall accuracy, McNemar p-values vs dense, heatmaps (PNG) if plot_dir."""
    cells = grid_samples(lambda s: len(prompt_ids(s)), lengths, depths, per_cell, max_new_tokens, seed)
    outcomes: dict[str, list[bool]] = {m.label: [] for m in modes}
    acc = {m.label: np.full((len(depths), len(lengths)), np.nan) for m in modes}
    answers: list[dict[str, Any]] = []
    bar = tqdm(total=len(cells) * per_cell * len(modes), desc="niah", unit="run")
    for (n, d), samples in cells.items():
        i, j = depths.index(d), lengths.index(n)
        for s in samples:
            ids = prompt_ids(s)
            rec: dict[str, Any] = {"length": n, "depth": d, "prompt_tokens": len(ids), "needle": s.outputs[0]}
            for m in modes:
                text = decode_text(session.generate(m, ids, max_new_tokens, stop_ids))
                ok = ruler.string_match_all(text, s.outputs) == 1.0
                outcomes[m.label].append(ok)
                rec[m.label] = {"correct": ok, "text": text}
                bar.update(1)
            answers.append(rec)
        for m in modes:
            acc[m.label][i, j] = np.mean(outcomes[m.label][-len(samples):])
    bar.close()
    result: dict[str, Any] = {
        "lengths": list(lengths), "depths": list(depths), "per_cell": per_cell, "n": len(answers),
        "accuracy": {k: float(np.mean(v)) for k, v in outcomes.items()},
        "accuracy_grid": {k: v.tolist() for k, v in acc.items()}, "samples": answers}
    if "dense" in outcomes:
        result["mcnemar_vs_dense"] = {k: stats.mcnemar_exact(outcomes["dense"], v)
                                      for k, v in outcomes.items() if k != "dense"}
    if plot_dir:
        result["plots"] = [str(plots.niah_heatmap(acc[k], lengths, depths, f"NIAH accuracy, {k} cache",
                                                  f"{plot_dir}/niah_{_slug(k)}.png")) for k in acc]
    return result


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_")
