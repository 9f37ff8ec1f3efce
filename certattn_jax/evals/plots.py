"""Plots of the evaluation (matplotlib, Agg backend, PNG files): NIAH heatmaps, bound vs true error, rungs
per layer, tightness histogram."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def niah_heatmap(acc: np.ndarray, lengths: Sequence[int], depths: Sequence[int], title: str, path: str | Path) -> Path:
    """acc [len(depths), len(lengths)] in [0, 1] (NaN = not run) as a red-green heatmap with the values."""
    plt = _plt()
    acc = np.asarray(acc, float)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 + 0.9 * len(lengths)), 1.2 + 0.45 * len(depths)))
    im = ax.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            if np.isfinite(acc[i, j]):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    return _save(fig, path)


def bound_vs_error(samples: np.ndarray, title: str, path: str | Path) -> Path:
    """samples [n, 4] = (bound, true_error, layer, rung): log-log scatter with the y = x line (sound: all
    points on or below it)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 4.5))
    s = samples[(samples[:, 1] > 0) & (samples[:, 0] > 0) & np.isfinite(samples[:, 0])]
    if s.size:
        sc = ax.scatter(s[:, 0], s[:, 1], c=s[:, 3], s=3, cmap="viridis", vmin=0, vmax=4, alpha=0.5)
        fig.colorbar(sc, ax=ax, label="rung")
        lo, hi = min(s[:, 0].min(), s[:, 1].min()), max(s[:, 0].max(), s[:, 1].max())
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="true error = bound")
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("certificate bound")
    ax.set_ylabel("true error vs exact attention (tier 2)")
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def rungs_per_layer(hist: np.ndarray, title: str, path: str | Path) -> Path:
    """hist [L, 5] head-step counts per rung: stacked bars of the share per layer."""
    plt = _plt()
    hist = np.asarray(hist, float)
    share = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(max(5, 0.25 * len(hist)), 3.5))
    bottom = np.zeros(len(hist))
    names = ("0 certified", "1 widened K*", "2 exact values", "3 exact head", "4 exact layer")
    for r in range(5):
        ax.bar(range(len(hist)), share[:, r], bottom=bottom, label=names[r])
        bottom += share[:, r]
    ax.set_xlabel("layer")
    ax.set_ylabel("share of head-steps")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
