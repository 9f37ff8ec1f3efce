"""Shared pieces of the shape audit (reviewer scripts; the library is imported, never modified).

Reuses the 2026-12-07 checkers: `check_any.check_step_any` (per head: error <= bound against a float64 numpy
reference over the stored originals, the certificate-field checks), `tv_common.cache_invariants`,
`hot_set_consistent`, `ratio_and_nan`, `TvTally`. Adds: data families parametric in (B, T, H, G, d, Bk, dtype),
and a tally that files two findings the existing checker raises by design as notes (see `ShapeTally`).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "audit_2026_12_07_timevarying"))
sys.path.insert(0, str(HERE.parent / "audit_2026_12_07"))
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from check_any import check_step_any  # noqa: E402,F401
from tv_common import PATH, TvTally, dequantized, f64, hot_set_consistent, ratio_and_nan, stored  # noqa: E402,F401

from certattn_jax import bounds  # noqa: E402


def _unit(rng, d):
    u = rng.standard_normal(d)
    return u / np.linalg.norm(u)


def lengths_for(B, Bk):
    """Ragged prefix lengths: shorter than a block, exactly at a block boundary, a partial residual block that
    flushes a few steps in (B = 1: the partial one)."""
    if B == 1:
        return np.array([3 * Bk - 4])
    return np.array([Bk - 5, 2 * Bk, 3 * Bk + Bk - 4][:B])


def family(name, rng, B, T, H, G, d, Bk, steps, dtype):
    """K, V [B, T, H, d] float64 (before the cast to the cache dtype), Q [steps, B, H*G, d]."""
    K = rng.standard_normal((B, T, H, d))
    V = rng.standard_normal((B, T, H, d))
    Q = rng.standard_normal((steps, B, H * G, d))
    f16 = jnp.dtype(dtype) == jnp.float16
    dmax = float(jnp.finfo(dtype).max)
    if name == "gauss":
        pass
    elif name == "needle":  # one token per (row, KV head) aligned with the group's queries, distinctive value
        for b in range(B):
            for h in range(H):
                u = _unit(rng, d)
                i = int(rng.integers(max(1, min(T - steps, Bk * 2))))
                K[b, i, h] = 4.0 * math.sqrt(d) * u / 2
                V[b, i, h] = 8.0
                j = T - steps + steps // 2  # a second, weaker needle written mid-run (residual, then flushed)
                K[b, j, h] = 3.5 * math.sqrt(d) * u / 2
                V[b, j, h] = -6.0
                Q[:, b, h * G:(h + 1) * G] = 2.0 * u + 0.1 * Q[:, b, h * G:(h + 1) * G]
    elif name == "near_ties":  # every block's keys are block 0's (+1e-3 noise); values differ per block
        base = K[:, :Bk].copy()
        for j in range(0, T, Bk):
            n = min(Bk, T - j)
            K[:, j:j + n] = base[:, :n] + 1e-3 * rng.standard_normal(K[:, j:j + n].shape)
        Q *= 2.0
    elif name == "v_outlier_channel":  # one value channel per KV head carries huge outliers
        for h in range(H):
            c = int(rng.integers(d))
            V[:, :, h, c] = V[:, :, h, c] * 300.0 + 2000.0
    elif name == "key_offset":  # keys with large per-channel means
        off = rng.choice([-1.0, 1.0], (1, 1, H, d)) * rng.uniform(20.0, 60.0, (1, 1, H, d))
        K = 0.5 * K + off
    elif name == "huge_q":  # softmax nearly one-hot
        Q *= 200.0 if f16 else 3000.0
        if f16:
            Q = np.clip(Q, -6e4, 6e4)
    elif name == "equal_keys":  # all keys of a (row, KV head) equal
        K[:] = K[:, :1]
    elif name == "denormal_v":  # values in the dtype's subnormal range
        V *= 2e-6 if f16 else 1e-39
    elif name == "extreme_v":  # values at the dtype's extremes (finite), mixed signs
        V = rng.choice([-1.0, 1.0], V.shape) * rng.uniform(0.5, 0.95, V.shape) * dmax
    elif name == "extreme_v_pos":  # values at the dtype's top, all positive (a finite range)
        V = rng.uniform(0.5, 0.98, V.shape) * dmax
    else:
        raise ValueError(name)
    if f16:
        K = np.clip(K, -6e4, 6e4)
        Q = np.clip(Q, -6e4, 6e4)
    return K, V, Q


FAMILIES = ("gauss", "needle", "near_ties", "v_outlier_channel", "key_offset", "huge_q", "equal_keys", "denormal_v",
            "extreme_v", "extreme_v_pos")


class ShapeTally(TvTally):
    """TvTally (which files the two known benign findings of probe_cert.check_step) that also files as a
    benign note:
      * "error nan > bound inf": a non-finite output with an infinite bound that is not certified (the suite's
        contract: `test_soundness_extreme.check`, "a non-finite output only with an infinite bound"); the
        certified-output NaN check of ratio_and_nan stays a violation;
      * "nonfinite set" from cache_invariants in the extreme-value families, where the quantization range of a
        block overflows float32 (by design: the KV head is then never certified)."""

    def __init__(self, name):
        super().__init__(name)
        self.benign.update({"nonfinite_out_inf_bound": [0, 0.0], "nonfinite_flag_extreme": [0, 0.0]})
        self.pinned = [0, 0]
        self.ambiguous = [0, 0]
        self.extreme = False

    def bad(self, msg):
        m = re.search(r"error (nan|inf) > bound (inf)", msg)
        if m and "certified" not in msg:
            self.benign["nonfinite_out_inf_bound"][0] += 1
            return
        if self.extreme and msg.endswith("nonfinite set"):
            self.benign["nonfinite_flag_extreme"][0] += 1
            return
        super().bad(msg)


def f64_arr(x):
    """Any array (bf16 / f16 / f32) as float64, through float32 (exact)."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


TINY = float(np.finfo(np.float32).tiny)


def ftz(x):
    """x with float32 subnormals flushed to zero (what XLA:CPU arithmetic sees: bounds.TINY's comment)."""
    x = np.asarray(x, np.float64)
    return np.where(np.abs(x) < TINY, 0.0, x)


def cache_invariants(t, tag, c, K, V, lens, maintained=True):
    """tv_common.cache_invariants, copied, with two changes: (1) running statistics (v_min, v_max, v_norm_max)
    are compared with the stored values *with float32 subnormals flushed to zero* (XLA:CPU flushes them; the bound
    covers what is lost by absolute TINY terms: bounds.underflow_*), and the value-error annotations may fall
    short of the float64 truth by at most 4 (Bk + d) TINY; (2) a block whose dequantized values are not finite
    (a quantization range that overflows float32) must carry the KV head's non-finite flag, and its value-error
    checks are skipped (numpy's spectral norm fails on inf)."""
    Bk = c.block_size
    d = c.head_dim
    slack = 4 * (Bk + d) * TINY
    L = np.asarray(c.lengths)
    F = np.asarray(c.flushed)
    if not np.array_equal(L, lens):
        t.bad(f"{tag}: lengths {L} != expected {lens}")
    khat, vhat = dequantized(c)
    ks = f64(c.k_scale)
    hk = f64(c.host_k if c.layer is None else c.host_k[int(c.layer)])
    hv = f64(c.host_v if c.layer is None else c.host_v[int(c.layer)])
    v_err, v_mean, v_op = f64(c.v_err), f64(c.v_mean_err), f64(c.v_err_op)
    nonfinite = np.asarray(c.nonfinite)
    for b, n in enumerate(lens):
        if (maintained and F[b] != (n // Bk) * Bk) or F[b] % Bk or not (0 <= n - F[b] <= Bk):
            t.bad(f"{tag} b={b}: flushed {F[b]} for length {n}")
        for h in range(c.num_kv_heads):
            for j in range(F[b] // Bk):
                blk = slice(j * Bk, (j + 1) * Bk)
                if not (np.array_equal(hk[b, h, j], K[b, blk, h]) and np.array_equal(hv[b, h, j], V[b, blk, h])):
                    t.bad(f"{tag} b={b} h={h} blk={j}: tier 2 differs from the originals")
                if not (np.all(np.isfinite(khat[b, h, j])) and np.all(np.isfinite(vhat[b, h, j]))):
                    # a finite block whose range overflows float32 gets an infinite scale and v_err (so every
                    # bound touching it is infinite); non-finite inputs set the flag
                    if nonfinite[b, h] or (np.isinf(v_err[b, h, j]) and np.all(np.isfinite(khat[b, h, j]))):
                        t.benign.setdefault("tier1_overflow_inf_annotation", [0, 0.0])[0] += 1
                    else:
                        t.bad(f"{tag} b={b} h={h} blk={j}: non-finite tier 1, v_err {v_err[b, h, j]}, no flag")
                    continue
                kerr = np.abs(khat[b, h, j] - K[b, blk, h])
                if np.any(kerr > ks[b, h, j] * (0.5 + 2 ** -12) + 1e-30):
                    t.bad(f"{tag} b={b} h={h} blk={j}: key error {kerr.max()} > s/2")
                E = V[b, blk, h] - vhat[b, h, j]
                tok = np.linalg.norm(E, axis=-1).max()
                if tok > v_err[b, h, j] + slack:
                    t.bad(f"{tag} b={b} h={h} blk={j}: value error {tok} > v_err {v_err[b, h, j]}")
                if np.linalg.norm(E.mean(0)) > v_mean[b, h, j] + slack:
                    t.bad(f"{tag} b={b} h={h} blk={j}: mean value error {np.linalg.norm(E.mean(0))} > v_mean_err")
                if np.linalg.norm(E, 2) > v_op[b, h, j] + slack * Bk:
                    t.bad(f"{tag} b={b} h={h} blk={j}: spectral value error {np.linalg.norm(E, 2)} > v_err_op")
                if v_err[b, h, j] > float(np.asarray(c.v_err_max)[b, h]):
                    t.bad(f"{tag} b={b} h={h} blk={j}: v_err above v_err_max")
            if n:
                res = c.res_v[b, h, :n - F[b]]
                if not np.array_equal(f64(res), V[b, F[b]:n, h]) or not np.array_equal(
                        f64(c.res_k[b, h, :n - F[b]]), K[b, F[b]:n, h]):
                    t.bad(f"{tag} b={b} h={h}: residual differs from the originals")
                vv = ftz(V[b, :n, h])
                vmin, vmax = ftz(np.asarray(c.v_min, np.float64)[b, h]), ftz(np.asarray(c.v_max, np.float64)[b, h])
                if not (np.array_equal(vmin, vv.min(0)) and np.array_equal(vmax, vv.max(0))):
                    t.bad(f"{tag} b={b} h={h}: v_min/v_max differ from the stored range (subnormals flushed)")
                nm = np.linalg.norm(vv, axis=-1).max()
                if nm > float(np.asarray(c.v_norm_max)[b, h]):
                    t.bad(f"{tag} b={b} h={h}: v_norm_max {float(np.asarray(c.v_norm_max)[b, h])} below a stored "
                          f"norm {nm}")
            if nonfinite[b, h] and not t.extreme:
                t.bad(f"{tag} b={b} h={h}: nonfinite set")
    hot_set_consistent(t, tag, c, K, V)
    cols = bounds.value_statistics(c.v_min, c.v_max, c.v_err_max, c.v_scale_max, c.v_zero_max, Bk, c.value_bits)
    rec = np.stack([np.asarray(x) for x in cols], -1).astype(np.float64)
    st = np.asarray(c.value_stats, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(rec - st) / np.maximum(np.abs(rec), 1e-30)
    same = (rec == st) | (np.isnan(rec) & np.isnan(st))
    rel = float(np.max(np.where(same, 0.0, rel), initial=0.0))
    if not rel <= 1e-5:
        t.bad(f"{tag}: value_stats off by {rel} relative from recomputed")
    if np.any(np.asarray(c.hot_pending) >= 0):
        t.bad(f"{tag}: hot_pending not clear")


def _note(self, msg):
    """Notes: "tolerance inf above eps*range" (a stored range beyond float32: tolerance +inf, as eps * range is)
    is counted, not printed."""
    if "tolerance inf above" in msg:
        self.benign.setdefault("tolerance_inf_range_overflow", [0, 0.0])[0] += 1
        return
    TvTally.note(self, msg)


ShapeTally.note = _note
