# ruff: noqa: E402  (the sys.path setup above the imports: run as a script from anywhere)
"""Thirtieth-session soundness audit probe (docs/performance.md, thirtieth session); see README.md here."""

import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.abspath(_os.path.join(_HERE, "..", "..", ".."))
for _p in (_ROOT, _os.path.join(_ROOT, "tests"), _os.path.join(_ROOT, "scripts", "soundness_probe"), _HERE):
    if _p not in _sys.path:
        _sys.path.insert(0, _p)
import math

import audit2
import jax.numpy as jnp
import numpy as np

_orig = audit2.draw


def draw(rng, family, B, N, H, G, D, dtype, policy):
    Bk = policy.block_size
    def g():
        return _orig(rng, "gauss", B, N, H, G, D, dtype, policy)
    fmax = float(jnp.finfo(dtype).max)
    if family == "dot_ovf":  # two channels whose products ~1e38: some scores overflow, others finite
        q, k, v = g()
        m = 10 ** rng.uniform(18.3, 19.4)
        k[..., 0] *= m
        k[..., 1] *= m * rng.uniform(0.5, 1.5)
        sel = rng.random((N, B, H * G)) < 0.5
        q[..., 0] = np.where(sel, q[..., 0] * m, q[..., 0])
        q[..., 1] = np.where(sel, np.abs(q[..., 1]) * m, q[..., 1])
        return q, k, v
    if family == "dot_ovf_one":  # one channel product near fmax, rest ordinary
        q, k, v = g()
        m = math.sqrt(3.0e38 * math.sqrt(D)) * rng.uniform(0.5, 1.05)
        k[..., 3] = np.abs(k[..., 3]) * m / 3 * rng.choice([1, -1], size=k[..., 3].shape)
        sel = rng.random((N, B, H * G)) < 0.7
        q[..., 3] = np.where(sel, m, 1.0)
        return q, k, v
    if family in ("scale_ovf", "scale_ovf_zmin"):  # one key channel spans +-fmax in some blocks; q exactly 0 there
        q, k, v = g()
        nb = N // Bk + 1
        for b in range(B):
            for h in range(H):
                for j in rng.choice(nb, size=max(1, nb // 2), replace=False):
                    lo = j * Bk
                    hi = min(N, lo + Bk)
                    if hi <= lo:
                        continue
                    k[b, lo:hi, h, 5] = rng.uniform(-1, 1, hi - lo) * fmax * 0.99
                    if family == "scale_ovf_zmin":
                        k[b, lo, h, 5] = -fmax
        q[..., 5] = 0.0
        return q, k, v
    if family == "scale_ovf_qsmall":  # same, q small but nonzero in that channel (scores ~ +-few nats there)
        q, k, v = draw(rng, "scale_ovf", B, N, H, G, D, dtype, policy)
        q[..., 5] = rng.choice([1e-38, 3e-38, 1e-37], size=q[..., 5].shape) * math.sqrt(D)
        return q, k, v
    if family == "v_huge_pos":  # values ~ fmax/8..fmax/2 same sign: sums of B weights overflow
        q, k, v = g()
        v = np.abs(v) / 4.5 * fmax * rng.uniform(0.05, 0.5) + fmax * 0.01
        return q, k, v
    if family == "v_huge_mid":  # values 1e37 +- : range finite, norms near overflow
        q, k, v = g()
        v = v * 1e36 + 1e37 * rng.uniform(0.5, 3)
        return q, k, v
    if family == "q_one_huge":  # one q element 1e30 over a key channel of tiny spread, rest ordinary
        q, k, v = g()
        k[..., 7] = rng.standard_normal(k[..., 7].shape) * 10 ** rng.uniform(-31, -28)
        q[..., 7] = rng.choice([1e30, -1e30, 3e29], size=q[..., 7].shape)
        return q, k, v
    if family == "q_one_huge_const":  # q element 1e30 over a constant key channel (shifts all scores equally)
        q, k, v = g()
        k[..., 7] = 10 ** rng.uniform(-32, -29)
        q[..., 7] = 1e30
        return q, k, v
    if family == "f16_subnormal_vals":
        q, k, v = g()
        v = v * 10 ** rng.uniform(-9, -6.5, size=(B, N, H, 1))
        return q, k, v
    if family == "f16_subnormal_vals_needle":
        q, k, v = draw(rng, "f16_subnormal_vals", B, N, H, G, D, dtype, policy)
        for b in range(B):
            for h in range(H):
                i = rng.integers(N)
                k[b, i, h] = q[-1, b, h * G] / np.linalg.norm(q[-1, b, h * G]) * math.sqrt(D) * 3
                v[b, i, h] *= 1e4
        return q, k, v
    if family == "v_f16_near_max":  # values near f16 max with offset
        q, k, v = g()
        v = np.clip(65000 - np.abs(v) * 300, -65504, 65504)
        return q, k, v
    # ---------- drift families (long decodes): abrupt changes at block boundaries
    if family == "drift_vals":  # values ~1 then ~1e4 from a block boundary onward
        q, k, v = g()
        cut = (N // 2) // Bk * Bk + rng.integers(0, 2) * rng.integers(1, Bk)
        v[:, cut:] *= 1e4 if dtype != jnp.float16 else 1e3
        return q, k, v
    if family == "drift_keys":  # key offset jumps at every block boundary; q follows half the time
        q, k, v = g()
        nb = N // Bk + 1
        off = rng.standard_normal((B, nb, H, D)) * rng.uniform(1, 6)
        k = k + np.repeat(off, Bk, axis=1)[:, :N]
        q = q * rng.uniform(0.5, 2.5)
        return q, k, v
    if family == "needle_mid":  # a needle written mid-decode; every later query points at it
        q, k, v = g()
        i0 = N - N // 3
        dirn = rng.standard_normal((B, H, D))
        dirn /= np.linalg.norm(dirn, axis=-1, keepdims=True)
        for b in range(B):
            for h in range(H):
                k[b, i0, h] = dirn[b, h] * math.sqrt(D) * rng.uniform(2, 5)
                v[b, i0, h] = rng.standard_normal(D) * 50
                q[i0:, b, h * G : (h + 1) * G] += dirn[b, h] * math.sqrt(D) * 1.5
        return q, k, v
    if family == "drift_scale_mix":  # per-block value scale from 1e-3 to 1e4, keys scale per block too
        q, k, v = g()
        nb = N // Bk + 1
        vs = 10 ** rng.uniform(-3, 4 if dtype != jnp.float16 else 3, size=(B, nb, H, 1))
        ksc = 10 ** rng.uniform(-1, 0.8, size=(B, nb, H, 1))
        v = v * np.repeat(vs, Bk, axis=1)[:, :N]
        k = k * np.repeat(ksc, Bk, axis=1)[:, :N]
        return q, k, v
    return _orig(rng, family, B, N, H, G, D, dtype, policy)


audit2.draw = draw
try:
    import model_audit

    model_audit.draw = draw
except Exception as e:
    print("model_audit import", e)
