"""Shared pieces of the time-varying-attention audit (reviewer scripts; the library is imported, never modified).

The per-head checks are the 2026-12-07 audit's (`audit_2026_12_07/probe_cert.py::check_step`: error vs a float64
reference over the stored originals computed with numpy, bound >= e_key + e_val + e_num, certified == (bound <=
tolerance), tolerance vs eps * stored range, rung 3/4 vs dense_attention, rungs 0-2: a set of k* exact blocks
(within the pre-call hot set at rung 0) reproduces the output, the e_key / e_val split, ranking truth) and
`common.hot_set_consistent`. This module adds: scenario data (attention that moves over time), the cache
invariants after a run, and a NaN-in-certified-output check.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "audit_2026_12_07"))
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import PATH, Tally, dequantized, f64, hot_set_consistent  # noqa: E402,F401
from probe_cert import check_step  # noqa: E402,F401

from certattn_jax import bounds  # noqa: E402


def stored(x, dtype):
    """x as the cache stores it (cast to dtype), as float32."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))


def unit(rng, d):
    u = rng.standard_normal(d)
    return u / np.linalg.norm(u)


# --------------------------------------------------------------------------------------------------- scenarios
# Each returns dict(K [B, T, H, d], V, Q [steps, B, Hq, d] (float32, before the cast to the cache dtype), L0 [B],
# active [steps, B] bool). Row b's tokens are K[b, :len_b]: the prefix K[b, :L0[b]], then one token per active step.

def _base(rng, B, T, H, d):
    return 0.8 * rng.standard_normal((B, T, H, d)), rng.standard_normal((B, T, H, d))


def _aligned(rng, K, b, lo, hi, h, u, mag, noise=0.3):
    K[b, lo:hi, h] = mag * u + noise * rng.standard_normal((hi - lo, u.shape[0]))


def _q_toward(rng, u, mag, G, noise=0.15):
    return np.stack([mag * u + noise * rng.standard_normal(u.shape[0]) for _ in range(G)])


def sc_switch_ab(rng, B, H, G, d, Bk, steps):
    """Blocks A (id 1) attended for the first half (A goes hot), then a sharp switch to block B (id 3), whose
    twin C (id 4) has keys = B's minus ~0.45 of a quantization step against the query direction: INT scores
    nearly tied with B's, exact scores lower (ranking disagreement); one token of B is a strong needle."""
    L0 = np.array([5 * Bk + 3] + [4 * Bk + 7] * (B - 1))[:B]
    T = int(L0.max()) + steps
    K, V = _base(rng, B, T, H, d)
    Q = np.zeros((steps, B, H * G, d))
    sw = steps // 2
    for b in range(B):
        nblk = L0[b] // Bk
        a, bb, c = 1, min(3, nblk - 2), min(4, nblk - 1)
        for h in range(H):
            uA, uB = unit(rng, d), unit(rng, d)
            _aligned(rng, K, b, a * Bk, (a + 1) * Bk, h, uA, 2.5)
            _aligned(rng, K, b, bb * Bk, (bb + 1) * Bk, h, uB, 2.0)
            K[b, bb * Bk + 5, h] = 3.5 * uB
            if c != bb:
                blk = K[b, bb * Bk:(bb + 1) * Bk, h]
                s = (blk.max(0) - blk.min(0)) / 255.0 * 16  # ~ a 4-bit step (the 8-bit one is 16x smaller)
                K[b, c * Bk:(c + 1) * Bk, h] = blk - 0.45 * s * np.sign(uB)
                V[b, c * Bk:(c + 1) * Bk, h] = -V[b, bb * Bk:(bb + 1) * Bk, h] + 2.0
            for s_ in range(steps):
                u = uA if s_ < sw else uB
                Q[s_, b, h * G:(h + 1) * G] = _q_toward(rng, u, 2.2 * math.sqrt(d) / 2, G)
    return dict(K=K, V=V, Q=Q, L0=L0, active=np.ones((steps, B), bool))


def sc_needle_late(rng, B, H, G, d, Bk, steps):
    """A needle token written into the residual at decode step 2 (its block flushed later, its annotations computed
    at that flush), a weaker second needle at step 5; diffuse queries until steps - 10, then queries aimed at the
    needle (after several flushes for Bk 16), with the second needle competing."""
    L0 = np.array([2 * Bk + Bk // 2 - 1, Bk - 1, 3 * Bk - 3][:B])
    T = int(L0.max()) + steps
    K, V = _base(rng, B, T, H, d)
    Q = 0.4 * rng.standard_normal((steps, B, H * G, d))
    for b in range(B):
        for h in range(H):
            uN = unit(rng, d)
            u2 = 0.8 * uN + 0.6 * unit(rng, d)
            u2 /= np.linalg.norm(u2)
            i1, i2 = L0[b] + 2, L0[b] + 5
            K[b, i1, h] = 1.6 * math.sqrt(d) * uN
            V[b, i1, h] = 0.0
            V[b, i1, h, 0] = 6.0
            K[b, i2, h] = 1.5 * math.sqrt(d) * u2
            V[b, i2, h] = -3.0
            for s_ in range(max(0, steps - 10), steps):
                Q[s_, b, h * G:(h + 1) * G] = _q_toward(rng, uN, 1.2 * math.sqrt(d) / 2, G)
    return dict(K=K, V=V, Q=Q, L0=L0, active=np.ones((steps, B), bool))


def sc_late_outliers(rng, B, H, G, d, Bk, steps):
    """Decode tokens in the last 3 positions of their block carry value outliers (x40 in channels 0-2, of mixed
    sign) and keys aligned with u: the annotations computed at the flush must cover them. Queries alternate
    every 3 steps between u (attends the outliers, flushed or still in the residual) and random."""
    L0 = np.array([2 * Bk + 1, Bk + 9, 4 * Bk - 2][:B])
    T = int(L0.max()) + steps
    K, V = _base(rng, B, T, H, d)
    Q = rng.standard_normal((steps, B, H * G, d))
    for b in range(B):
        for h in range(H):
            u = unit(rng, d)
            for i in range(L0[b], T):
                if i % Bk >= Bk - 3:
                    K[b, i, h] = 1.2 * math.sqrt(d) * u + 0.3 * rng.standard_normal(d)
                    V[b, i, h, :3] = 40.0 * rng.choice([-1.0, 1.0], 3) * (1 + rng.random(3))
            for s_ in range(steps):
                if (s_ // 3) % 2 == 0:
                    Q[s_, b, h * G:(h + 1) * G] = _q_toward(rng, u, 1.5 * math.sqrt(d) / 2, G)
    return dict(K=K, V=V, Q=Q, L0=L0, active=np.ones((steps, B), bool))


def sc_alternate(rng, B, H, G, d, Bk, steps):
    """Two query distributions (toward block A = 0 or block B = last full prefix block) alternating every step for
    12 steps, then A for a long streak, then a sharp change to B, then alternating again (the last 6 steps)."""
    L0 = np.array([4 * Bk + 2, 3 * Bk, 5 * Bk - 1][:B])
    T = int(L0.max()) + steps
    K, V = _base(rng, B, T, H, d)
    Q = np.zeros((steps, B, H * G, d))
    sharp = 12 + (steps - 18) // 2 + 12 - 12
    for b in range(B):
        nb = L0[b] // Bk
        for h in range(H):
            uA, uB = unit(rng, d), unit(rng, d)
            _aligned(rng, K, b, 0, Bk, h, uA, 2.5)
            _aligned(rng, K, b, (nb - 1) * Bk, nb * Bk, h, uB, 2.5)
            V[b, (nb - 1) * Bk:nb * Bk, h] += 5.0
            for s_ in range(steps):
                if s_ < 12 or s_ >= steps - 6:
                    u = uA if s_ % 2 == 0 else uB
                else:
                    u = uA if s_ < sharp else uB
                Q[s_, b, h * G:(h + 1) * G] = _q_toward(rng, u, 2.0 * math.sqrt(d) / 2, G)
    return dict(K=K, V=V, Q=Q, L0=L0, active=np.ones((steps, B), bool))


def sc_ragged_stop(rng, B, H, G, d, Bk, steps):
    """Three sequences of ragged lengths (one of a single token); only sequence 0's attention moves (block 1 ->
    block 3 at mid-run); sequence 2 stops (active False) after steps // 3 and never resumes; its query keeps
    changing direction every step (its certificate is still checked over its frozen tokens)."""
    B = 3
    L0 = np.array([4 * Bk + 5, 1, 2 * Bk + Bk // 2])
    T = int(L0.max()) + steps
    K, V = _base(rng, B, T, H, d)
    Q = np.zeros((steps, B, H * G, d))
    act = np.ones((steps, B), bool)
    act[steps // 3:, 2] = False
    for h in range(H):
        uA, uB = unit(rng, d), unit(rng, d)
        _aligned(rng, K, 0, Bk, 2 * Bk, h, uA, 2.5)
        _aligned(rng, K, 0, 3 * Bk, 4 * Bk, h, uB, 2.5)
        u1 = unit(rng, d)
        _aligned(rng, K, 2, Bk, 2 * Bk, h, u1, 2.0)
        for s_ in range(steps):
            Q[s_, 0, h * G:(h + 1) * G] = _q_toward(rng, uA if s_ < steps // 2 else uB, 2.0 * math.sqrt(d) / 2, G)
            Q[s_, 1, h * G:(h + 1) * G] = _q_toward(rng, u1, 1.0, G)
            Q[s_, 2, h * G:(h + 1) * G] = _q_toward(rng, unit(rng, d), 2.0 * math.sqrt(d) / 2, G)
    return dict(K=K, V=V, Q=Q, L0=L0, active=act)


SCENARIOS = {"switch_ab": sc_switch_ab, "needle_late": sc_needle_late, "late_outliers": sc_late_outliers,
             "alternate": sc_alternate, "ragged_stop": sc_ragged_stop}


# ------------------------------------------------------------------------------------------------ invariants
def cache_invariants(t: Tally, tag, c, K, V, lens, maintained=True):
    """A single-layer cache (or a model's layer view) against the stored originals K, V [B, T, H, d] (float64)
    of rows of lengths lens: lengths, flushed, tier 2 == originals, tier 1 within its annotations (keys within
    s (1/2 + rho), token value errors <= v_err, the mean / spectral error annotations >= their float64 truth,
    v_err_max >= every v_err), running range == the stored range, v_norm_max >= every stored norm, value_stats
    == recomputed, the hot set == its blocks' originals, no non-finite flag, hot_pending clear."""
    Bk = c.block_size
    L = np.asarray(c.lengths)
    F = np.asarray(c.flushed)
    if not np.array_equal(L, lens):
        t.bad(f"{tag}: lengths {L} != expected {lens}")
    khat, vhat = dequantized(c)
    ks = f64(c.k_scale)
    hk = f64(c.host_k if c.layer is None else c.host_k[int(c.layer)])
    hv = f64(c.host_v if c.layer is None else c.host_v[int(c.layer)])
    v_err, v_mean, v_op = f64(c.v_err), f64(c.v_mean_err), f64(c.v_err_op)
    for b, n in enumerate(lens):
        # after a model step's maintenance every full block is flushed; a single-layer cache flushes before the
        # next write (flush -> write_token), so between calls its residual may be full: 0 <= n - flushed <= Bk
        if (maintained and F[b] != (n // Bk) * Bk) or F[b] % Bk or not (0 <= n - F[b] <= Bk):
            t.bad(f"{tag} b={b}: flushed {F[b]} for length {n}")
        for h in range(c.num_kv_heads):
            for j in range(F[b] // Bk):
                blk = slice(j * Bk, (j + 1) * Bk)
                if not (np.array_equal(hk[b, h, j], K[b, blk, h]) and np.array_equal(hv[b, h, j], V[b, blk, h])):
                    t.bad(f"{tag} b={b} h={h} blk={j}: tier 2 differs from the originals")
                kerr = np.abs(khat[b, h, j] - K[b, blk, h])
                if np.any(kerr > ks[b, h, j] * (0.5 + 2 ** -12) + 1e-30):
                    t.bad(f"{tag} b={b} h={h} blk={j}: key error {kerr.max()} > s/2")
                E = V[b, blk, h] - vhat[b, h, j]
                tok = np.linalg.norm(E, axis=-1).max()
                if tok > v_err[b, h, j]:
                    t.bad(f"{tag} b={b} h={h} blk={j}: value error {tok} > v_err {v_err[b, h, j]}")
                if np.linalg.norm(E.mean(0)) > v_mean[b, h, j]:
                    t.bad(f"{tag} b={b} h={h} blk={j}: mean value error {np.linalg.norm(E.mean(0))} > v_mean_err")
                if np.linalg.norm(E, 2) > v_op[b, h, j]:
                    t.bad(f"{tag} b={b} h={h} blk={j}: spectral value error {np.linalg.norm(E, 2)} > v_err_op")
                if v_err[b, h, j] > float(np.asarray(c.v_err_max)[b, h]):
                    t.bad(f"{tag} b={b} h={h} blk={j}: v_err above v_err_max")
            if n:
                res = c.res_v[b, h, :n - F[b]]
                if not np.array_equal(f64(res), V[b, F[b]:n, h]) or not np.array_equal(
                        f64(c.res_k[b, h, :n - F[b]]), K[b, F[b]:n, h]):
                    t.bad(f"{tag} b={b} h={h}: residual differs from the originals")
                vv = V[b, :n, h]
                if not (np.array_equal(np.asarray(c.v_min)[b, h], vv.min(0))
                        and np.array_equal(np.asarray(c.v_max)[b, h], vv.max(0))):
                    t.bad(f"{tag} b={b} h={h}: v_min/v_max differ from the stored range")
                if np.linalg.norm(vv, axis=-1).max() > float(np.asarray(c.v_norm_max)[b, h]):
                    t.bad(f"{tag} b={b} h={h}: v_norm_max below a stored norm")
            if np.asarray(c.nonfinite)[b, h]:
                t.bad(f"{tag} b={b} h={h}: nonfinite set")
    hot_set_consistent(t, tag, c, K, V)
    cols = bounds.value_statistics(c.v_min, c.v_max, c.v_err_max, c.v_scale_max, c.v_zero_max, Bk, c.value_bits)
    rec = np.stack([np.asarray(x) for x in cols], -1).astype(np.float64)
    st = np.asarray(c.value_stats, np.float64)
    rel = float(np.max(np.abs(rec - st) / np.maximum(np.abs(rec), 1e-30)))
    if rel > 1e-5:
        t.bad(f"{tag}: value_stats off by {rel} relative from recomputed")
    if np.any(np.asarray(c.hot_pending) >= 0):
        t.bad(f"{tag}: hot_pending not clear")


def ratio_and_nan(t: Tally, tag, out, cert, K, V, lens, q):
    """The largest error / bound over the certified heads (float64 reference over the stored originals) and the
    NaN check on certified outputs; returns the max ratio seen (every head with a finite positive bound)."""
    o = f64(out)
    bound = np.asarray(cert.error_bound, np.float64)
    certd = np.asarray(cert.certified)
    q64 = f64(q)
    worst = 0.0
    B, Hq, _ = o.shape
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        ref = attn64(q64[b], K[b], V[b], n)
        for h in range(Hq):
            if certd[b, h] and not np.all(np.isfinite(o[b, h])):
                t.bad(f"{tag} b={b} h={h}: certified output holds NaN/Inf")
            if math.isfinite(bound[b, h]) and bound[b, h] > 0:
                err = float(np.linalg.norm(o[b, h] - ref[h]))
                r = err / bound[b, h]
                worst = max(worst, r)
                if r > getattr(t, "worst", (0.0,))[0]:
                    t.worst = (r, f"{tag} b={b} h={h} n={n} rung={int(np.asarray(cert.rung)[b, h])} "
                                  f"k*={int(np.asarray(cert.k_star)[b, h])} err={err:.4g} bound={bound[b, h]:.4g} "
                                  f"e_key={float(np.asarray(cert.e_key)[b, h]):.3g} "
                                  f"e_val={float(np.asarray(cert.e_val)[b, h]):.3g} "
                                  f"e_num={float(np.asarray(cert.e_num)[b, h]):.3g} certified={bool(certd[b, h])}")
    return worst


class TvTally(Tally):
    """Tally whose bad() reclassifies two findings of probe_cert.check_step that are not soundness violations
    (counted, with their worst size, in `benign`):
      * "tolerance ... below eps*range+abs_tol" by < 1e-4 relative: since the 2026-12-07 fix the tolerance is
        eps * a *lower* bound of the stored range (`bounds.tolerance_range`, ~1e-5 relative low at d = 16):
        the conservative direction; check_step predates the fix and allows 1e-6;
      * "rung-3 output differs from dense_attention" by <= 1 ulp of a 16-bit output (check_step's 1e-6 threshold
        is for float32 outputs): rung 3's own output is checked against float64 by the error <= bound test."""

    def __init__(self, name):
        super().__init__(name)
        self.benign = {"tolerance_low_rel": [0, 0.0], "rung3_vs_dense_16bit_ulp": [0, 0.0]}

    def bad(self, msg):
        import re
        m = re.search(r"tolerance ([0-9.e+-]+) below eps\*range\+abs_tol ([0-9.e+-]+)", msg)
        if m:
            tol, want = float(m.group(1)), float(m.group(2))
            rel = (want - tol) / want if want > 0 else math.inf
            if rel < 1e-4:
                b = self.benign["tolerance_low_rel"]
                b[0] += 1
                b[1] = max(b[1], rel)
                return
        m = re.search(r"rung-3 output differs from dense_attention by ([0-9.e+-]+)", msg)
        if m and getattr(self, "out_ulp", 0.0) and float(m.group(1)) <= self.out_ulp:
            b = self.benign["rung3_vs_dense_16bit_ulp"]
            b[0] += 1
            b[1] = max(b[1], float(m.group(1)))
            return
        super().bad(msg)

    def summary(self):
        return super().summary() + f" benign={self.benign} worst={getattr(self, 'worst', None)}"


from common import attn64, mixed64, split_errors, subsets  # noqa: E402,F401
from probe_cert import dense_jit  # noqa: E402,F401
