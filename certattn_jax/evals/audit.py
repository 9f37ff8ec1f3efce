"""Soundness audit: aggregates the per-step records streamed out of the decode loops (`decode.set_sink`).

Each record holds, for one decode step, leaves [L, B, Hq]: the certificate (certified cache) and, with an
audited cache, `true_error` = ||o_returned - o_exact||_2 where o_exact is float32 attention over the tier-2
originals of the same layer cache. A head-step is one (step, layer, batch row, query head).

    violation:  true_error > error_bound (the certificate claims a bound that does not hold; must never happen)
    tightness:  error_bound / true_error (>= 1 when sound; large = loose), over head-steps with true_error > 0

The float32 reference has its own rounding error (~1e-7 relative), so a head-step whose bound is below that
level (rung 3/4: exact attention, bound = the floating-point term) can show true_error > bound by a few ulps.
We count those separately as `violations_within_reference_rounding` (|excess| <= REF_RTOL * ||o_exact|| +
REF_ATOL); `violations` counts every strict excess, so nothing is hidden.

Memory is O(layers + kept samples): counts and histograms are accumulated, and at most `keep` head-steps
(a seeded uniform subsample) are kept for the scatter plot and the tightness quantiles.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

import numpy as np

REF_RTOL = 1e-5
REF_ATOL = 1e-6
TIGHTNESS_BINS = np.logspace(-1, 8, 91)


class AuditCollector:
    """Receives (step, record) from the loops; `summary()` gives the audit's numbers."""

    def __init__(self, num_layers: int, keep: int = 200_000, seed: int = 0, log: TextIO | None = None):
        self.L = num_layers
        self.keep = keep
        self.rng = np.random.default_rng(seed)
        self.log = log
        self.run = ""  # set by the session per prompt/window, written into the log rows
        self.steps = 0
        self.head_steps = 0
        self.violations = 0
        self.violations_in_rounding = 0
        self.max_excess = 0.0
        self.rungs = np.zeros((num_layers, 5), np.int64)
        self.k_star_sum = np.zeros(num_layers, np.float64)
        self.certified = 0
        self.tight_hist = np.zeros(len(TIGHTNESS_BINS) + 1, np.int64)
        self.zero_error = 0
        self.err_sum = np.zeros(num_layers, np.float64)
        self.rel_err_max = 0.0
        self.has_cert = False
        self.has_error = False
        self._seen = 0
        self._kept: list[np.ndarray] = []  # rows (bound, true_error, layer, rung)

    def __call__(self, step: int, rec: dict[str, Any]) -> None:
        cert = rec.get("cert")
        err = rec.get("true_error")
        self.steps += 1
        if cert is not None:
            self.has_cert = True
            rung = np.asarray(cert.rung)
            n = rung.size
            self.head_steps += n
            for r in range(5):
                self.rungs[:, r] += (rung == r).reshape(self.L, -1).sum(axis=1)
            self.k_star_sum += np.asarray(cert.k_star).reshape(self.L, -1).sum(axis=1)
            self.certified += int(np.asarray(cert.certified).sum())
        if err is not None:
            self.has_error = True
            err = np.asarray(err, np.float64)
            norm = np.asarray(rec["exact_norm"], np.float64)
            self.err_sum += err.reshape(self.L, -1).sum(axis=1)
            self.rel_err_max = max(self.rel_err_max, float(np.max(err / np.maximum(norm, 1e-30))))
            if cert is None:
                self.head_steps += err.size
        if cert is not None and err is not None:
            bound = np.asarray(cert.error_bound, np.float64)
            excess = err - bound
            bad = excess > 0
            in_rounding = bad & (excess <= REF_RTOL * norm + REF_ATOL)
            self.violations += int(bad.sum())
            self.violations_in_rounding += int(in_rounding.sum())
            if bad.any():
                self.max_excess = max(self.max_excess, float(excess[bad].max()))
            pos = err > 0
            self.zero_error += int((~pos).sum())
            ratio = bound[pos] / err[pos]
            self.tight_hist += np.bincount(np.searchsorted(TIGHTNESS_BINS, ratio), minlength=len(TIGHTNESS_BINS) + 1)
            layer = np.broadcast_to(np.arange(self.L)[:, None, None], bound.shape)
            rows = np.stack([bound.ravel(), err.ravel(), layer.ravel(), rung.ravel().astype(np.float64)], axis=1)
            self._reservoir(rows)
        if self.log is not None:
            self._write_log(step, rec)

    def _reservoir(self, rows: np.ndarray) -> None:
        """Keep a uniform random subset of at most `keep` rows over everything seen (reservoir sampling)."""
        for row in rows:
            self._seen += 1
            if len(self._kept) < self.keep:
                self._kept.append(row)
            else:
                j = int(self.rng.integers(self._seen))
                if j < self.keep:
                    self._kept[j] = row

    def _write_log(self, step: int, rec: dict[str, Any]) -> None:
        fields: dict[str, np.ndarray] = {}
        if "cert" in rec:
            cert = rec["cert"]
            fields.update({name: np.asarray(getattr(cert, name)) for name in cert.__dataclass_fields__})
        for name in ("true_error", "exact_norm"):
            if name in rec:
                fields[name] = np.asarray(rec[name])
        for layer in range(self.L):
            row = {"run": self.run, "step": step, "layer": layer}
            row.update({k: v[layer, 0].tolist() for k, v in fields.items()})
            self.log.write(json.dumps(row) + "\n")

    def samples(self) -> np.ndarray:
        """[n, 4] kept head-steps: (bound, true_error, layer, rung)."""
        return np.array(self._kept).reshape(-1, 4)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": self.steps, "head_steps": int(self.head_steps)}
        if self.has_error:
            out["mean_true_error_per_layer"] = (self.err_sum / max(self.head_steps / self.L, 1)).tolist()
            out["max_relative_true_error"] = self.rel_err_max
        if not self.has_cert:
            return out
        total = max(int(self.rungs.sum()), 1)
        out.update({
            "rung_histogram": self.rungs.sum(axis=0).tolist(),
            "rung_histogram_per_layer": self.rungs.tolist(),
            "mean_k_star": float(self.k_star_sum.sum() / total),
            "mean_k_star_per_layer": (self.k_star_sum / np.maximum(self.rungs.sum(axis=1), 1)).tolist(),
            "share_rung0": float(self.rungs[:, 0].sum() / total),
            "share_certified": self.certified / total,
        })
        if self.has_error:
            kept = self.samples()
            pos = kept[:, 1] > 0
            ratio = kept[pos, 0] / kept[pos, 1]
            q = np.quantile(ratio, [0.01, 0.1, 0.5, 0.9, 0.99]).tolist() if ratio.size else [None] * 5
            out.update({
                "violations": self.violations,
                "violations_within_reference_rounding": self.violations_in_rounding,
                "violations_beyond_reference_rounding": self.violations - self.violations_in_rounding,
                "max_excess": self.max_excess,
                "head_steps_with_zero_error": self.zero_error,
                "tightness_quantiles": dict(zip(["p01", "p10", "p50", "p90", "p99"], q, strict=True)),
                "tightness_median": q[2],
                "tightness_histogram": {"edges": TIGHTNESS_BINS.tolist(), "counts": self.tight_hist.tolist()},
                "samples_kept": int(kept.shape[0]),
            })
        return out
