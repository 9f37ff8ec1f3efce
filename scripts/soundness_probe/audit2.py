"""Generalized decode-step soundness audit (reviewer script). Imports the library; does not modify it.

A config: B, H, G, D, dtype (cache), qdtype, policy, initial ragged lengths L0 (prefill by from_dense), T decode
steps (write_token -> certified_attention_step -> flush, like scripts/soundness_audit.py), data family.
Every head of every checked step is compared with the float64 reference over what the cache stores.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import jax
import jax.numpy as jnp
import numpy as np
from float64_reference import attention_f64

from certattn_jax.attention import certified_attention_fast, certified_attention_step
from certattn_jax.cache import TieredKVCache


@functools.partial(jax.jit, static_argnames=("policy",))
def decode_step(cache, k, v, q, policy):
    cache = cache.flush().write_token(k, v)
    out, cert, cache = certified_attention_step(q, cache, policy)
    return cache, out, cert


@functools.partial(jax.jit, static_argnames=("policy", "top"))
def decode_fast(cache, k, v, q, policy, top):
    cache = cache.flush().write_token(k, v)
    out, cert, c2, esc = certified_attention_fast(q, cache, policy, top)
    return cache, out, cert, esc


@functools.partial(jax.jit, static_argnames=("policy", "capacity"))
def build(k, v, lengths, policy, capacity):
    return TieredKVCache.from_dense(k, v, policy=policy, capacity=capacity, lengths=lengths)


def fmax(dtype):
    return float(jnp.finfo(dtype).max)


def draw(rng, family, B, N, H, G, D, dtype, policy):
    """q [N, B, Hq, D], k, v [B, N, H, D] float64 (N tokens: prefix + decoded)."""
    k = rng.standard_normal((B, N, H, D))
    v = rng.standard_normal((B, N, H, D))
    q = rng.standard_normal((N, B, H * G, D))
    big = fmax(dtype)
    if family == "q_zero":
        q[:] = 0.0
    elif family == "q_tiny":
        q *= 1e-30
    elif family == "q_huge":
        q *= 1e4
    elif family == "q_mixed":  # per-step per-head magnitudes 0 / 1e-30 / 1 / 1e4
        mags = rng.choice([0.0, 1e-30, 1.0, 1e2, 1e4], size=(N, B, H * G, 1))
        q *= mags
    elif family == "key_spike":  # one enormous key token per (row, kv head)
        for b in range(B):
            for h in range(H):
                i = rng.integers(N)
                k[b, i, h] *= min(1e4, big / 8) if dtype != jnp.float32 else 10 ** rng.uniform(3, 8)
    elif family == "key_spike_aligned":  # one enormous key aligned with the query direction (needle), rest gauss
        for b in range(B):
            for h in range(H):
                i = rng.integers(N)
                k[b, i, h] = np.abs(k[b, i, h]) * 30
        q = np.abs(q)
    elif family == "val_const_one":  # values constant except one token
        c = rng.standard_normal((1, 1, 1, D)) * 3
        spike = v * 10 ** rng.uniform(0, 4)
        v = np.broadcast_to(c, v.shape).copy()
        for b in range(B):
            for h in range(H):
                i = rng.integers(N)
                v[b, i, h] = spike[b, i, h]
    elif family == "val_const":  # all values identical (zero range: tolerance abs_tol)
        v = np.broadcast_to(rng.standard_normal((1, 1, 1, D)), v.shape).copy()
    elif family == "f16_edge":  # magnitudes near the cache dtype's overflow
        s = big * 0.9 / 4.5
        k *= min(s, 1e4)
        v = np.clip(v * s, -big * 0.99, big * 0.99)
    elif family == "val_near_max":
        v = np.clip(v / 4.5 * big * 0.99, -big * 0.99, big * 0.99)
    elif family == "needle":
        for b in range(B):
            for h in range(H):
                i = rng.integers(N)
                qh = q[-1, b, h * G]
                k[b, i, h] = qh / np.linalg.norm(qh) * math.sqrt(D) * rng.uniform(1, 4)
    elif family == "huge_scores":
        k *= 10 ** rng.uniform(1, 3)
        q *= 10 ** rng.uniform(1, 3)
    elif family == "offset":
        v = 10 ** rng.uniform(0, 4) + v * 10 ** rng.uniform(-4, 0)
        k = k + rng.uniform(-50, 50)
    elif family == "tied":
        k = rng.standard_normal((B, 1, H, D)) + 1e-3 * k
    elif family == "q_nonfinite":
        n = rng.integers(N)
        q[n:, rng.integers(B), rng.integers(H * G), rng.integers(D)] = rng.choice([np.nan, np.inf, -np.inf])
    elif family == "kv_nonfinite":
        which = k if rng.random() < 0.5 else v
        which[rng.integers(B), rng.integers(N), rng.integers(H), rng.integers(D)] = rng.choice([np.nan, np.inf])
    elif family in ("val_block_const", "val_block_const_q0", "val_block_const_off"):
        Bk = policy.block_size
        g = policy.group_size
        L = (1 << policy.value_bits) - 1
        base = rng.integers(0, L, size=(B, N // Bk + 1, H, D)) + 0.5
        base[..., ::g] = 0.0
        base[..., 1::g] = L
        base = base / L * 10 ** rng.uniform(-2, 2)
        if family == "val_block_const_off":
            base += 10 ** rng.uniform(1, 4)
        v = np.repeat(base, Bk, axis=1)[:, :N]
        if family == "val_block_const_q0":
            q[:] = 0.0
        else:
            q *= 1e-3
    elif family in ("k_extreme", "v_extreme", "kv_extreme", "q_extreme", "k_extreme_same_sign"):
        M = float(jnp.finfo(dtype).max) * 0.999
        for b in range(B):
            for h in range(H):
                i, j = rng.integers(N, size=2)
                c = rng.integers(D)
                if family in ("k_extreme", "kv_extreme"):
                    k[b, i, h, c] = M
                    k[b, j, h, c] = -M
                if family == "k_extreme_same_sign":
                    k[b, i, h, :] = M * np.sign(q[-1, b, h * G])
                if family in ("v_extreme", "kv_extreme"):
                    v[b, i, h, c] = M
                    v[b, j, h, c] = -M
        if family == "q_extreme":
            q *= 1e37
    elif family == "gauss":
        q *= 10 ** rng.uniform(-2, 1)
    else:
        raise ValueError(family)
    return q, k, v


def run_config(
    *, B, H, G, D, dtype, qdtype, policy, L0, T, family, seed, every=1, fast=None, cap=None, build_policy=None
):
    bp = build_policy or policy
    rng = np.random.default_rng(seed)
    L0 = np.asarray(L0)
    N = int(L0.max()) + T
    cap = cap or (N + policy.block_size)
    q, k, v = draw(rng, family, B, N, H, G, D, dtype, policy)
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    qq = np.asarray(jnp.asarray(q.astype(np.float32)).astype(qdtype).astype(jnp.float32), np.float64)
    # what the cache stores: the dtype cast
    ks = np.asarray(jnp.asarray(k32).astype(dtype).astype(jnp.float32), np.float64)
    vs = np.asarray(jnp.asarray(v32).astype(dtype).astype(jnp.float32), np.float64)
    # row b: tokens [0, L0[b]) prefilled, then tokens L0max + t for step t. Build stored arrays per row.
    P = int(L0.max())
    pre_k = np.zeros((B, max(P, 1), H, D), np.float32)
    pre_v = np.zeros_like(pre_k)
    for b in range(B):
        pre_k[b, : L0[b]] = k32[b, : L0[b]]
        pre_v[b, : L0[b]] = v32[b, : L0[b]]
    if P > 0:
        cache = build(jnp.asarray(pre_k, dtype), jnp.asarray(pre_v, dtype), jnp.asarray(L0, jnp.int32), bp, cap)
    else:
        cache = TieredKVCache.init(batch=B, capacity=cap, num_kv_heads=H, head_dim=D, dtype=dtype, policy=bp)
    st = {"heads": 0, "viol": 0, "rungs": [0] * 5, "examples": [], "ratios": [], "esc": 0}
    for t in range(T):
        kt = k32[:, P + t : P + t + 1]
        vt = v32[:, P + t : P + t + 1]
        qt = jnp.asarray(q[P + t].astype(np.float32)).astype(qdtype)
        if fast is None:
            cache, out, cert = decode_step(cache, jnp.asarray(kt), jnp.asarray(vt), qt, policy)
            esc = np.zeros(B, bool)
        else:
            cache, out, cert, esc = decode_fast(cache, jnp.asarray(kt), jnp.asarray(vt), qt, policy, fast)
            esc = np.asarray(esc)
        if (t % every) and t != T - 1:
            continue
        c = jax.tree.map(np.asarray, cert)
        bound = c.error_bound.astype(np.float64)
        lens = L0 + t + 1
        Kr = np.zeros((B, int(lens.max()), H, D))
        Vr = np.zeros_like(Kr)
        for b in range(B):
            Kr[b, : L0[b]] = ks[b, : L0[b]]
            Vr[b, : L0[b]] = vs[b, : L0[b]]
            Kr[b, L0[b] : lens[b]] = ks[b, P : P + t + 1]
            Vr[b, L0[b] : lens[b]] = vs[b, P : P + t + 1]
        with np.errstate(all="ignore"):
            ref = attention_f64(qq[P + t], Kr, Vr, lens)
            o64 = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
            err = np.linalg.norm(o64 - ref, axis=-1)
        fin_kv = np.stack(
            [
                np.all(np.isfinite(Kr[b, : lens[b]]), axis=(0, 2)) & np.all(np.isfinite(Vr[b, : lens[b]]), axis=(0, 2))
                for b in range(B)
            ]
        )
        bad = ~np.repeat(fin_kv, G, axis=1) | ~np.all(np.isfinite(qq[P + t]), axis=-1)
        out_bad = ~np.all(np.isfinite(o64), axis=-1)
        viol = (
            np.isnan(bound)
            | (~bad & ~out_bad & ~(err <= bound))
            | (out_bad & np.isfinite(bound))
            | (bad & c.certified)
            | (bad & np.isfinite(bound))
        )
        viol &= ~esc[:, None]
        st["esc"] += int(esc.sum())
        st["heads"] += int((~np.repeat(esc[:, None], H * G, 1)).sum())
        for r in range(5):
            st["rungs"][r] += int(np.sum((c.rung == r) & ~esc[:, None]))
        f = np.isfinite(bound) & (err > 0) & ~bad
        st["ratios"] += (bound[f] / err[f]).tolist()
        if viol.any():
            st["viol"] += int(viol.sum())
            for b, h in np.argwhere(viol)[:3]:
                st["examples"].append(
                    {
                        "t": t,
                        "b": int(b),
                        "h": int(h),
                        "len": int(lens[b]),
                        "err": float(err[b, h]),
                        "bound": float(bound[b, h]),
                        "rung": int(c.rung[b, h]),
                        "certified": bool(c.certified[b, h]),
                        "bad": bool(bad[b, h]),
                        "out_bad": bool(out_bad[b, h]),
                        "e_key": float(c.e_key[b, h]),
                        "e_val": float(c.e_val[b, h]),
                        "e_num": float(c.e_num[b, h]),
                    }
                )
    return st
