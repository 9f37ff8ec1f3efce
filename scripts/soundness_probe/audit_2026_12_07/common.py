"""Shared helpers of the 2026-12-07 certificate-truthfulness audit (reviewer scripts; they import the library and
never modify it). Run every script from the repository root:

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07/<script>.py

Kernel path: prefix with  CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused CERTATTN_FETCH_KERNEL=1
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from certattn_jax import quant  # noqa: E402

U = 2.0 ** -24
PATH = "kernel" if os.environ.get("CERTATTN_TIER1") == "pallas" else "jnp"


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def attn64(q, k, v, n):
    """Exact attention (float64) of q [Hq, d] over k, v [T, H, d], the first n tokens. [Hq, d]."""
    q, k, v = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(v, np.float64)
    Hq, d = q.shape
    H = k.shape[1]
    G = Hq // H
    out = np.full((Hq, d), np.nan)
    for h in range(Hq):
        if n == 0:
            continue
        s = k[:n, h // G] @ q[h] / math.sqrt(d)
        w = np.exp(s - s.max())
        out[h] = w @ v[:n, h // G] / w.sum()
    return out


def dequantized(cache):
    """(k_hat, v_hat) [B, H, nb, Bk, d] float64 of a single-layer cache's tier 1."""
    kh = quant.dequantize_keys(cache.k_codes, cache.k_scale, cache.k_zero, cache.key_bits)
    vh = quant.dequantize_values(cache.v_codes, cache.v_scale, cache.v_zero, cache.group_size, cache.value_bits)
    return np.asarray(kh, np.float64), np.asarray(vh, np.float64)


def mixed64(q, korig, vorig, khat, vhat, n_len, n_full, Bk, exact_blocks):
    """Attention of one query head q [d] over one KV head's tokens: blocks in exact_blocks (set) and the residual
    exact, the other full blocks dequantized. korig/vorig [T, d] originals; khat/vhat [nb, Bk, d]. Returns
    (out [d], p [n], s [n], k_used, v_used)."""
    d = q.shape[0]
    k = np.array(korig[:n_len], np.float64)
    v = np.array(vorig[:n_len], np.float64)
    for j in range(n_full):
        if j not in exact_blocks:
            k[j * Bk:(j + 1) * Bk] = khat[j]
            v[j * Bk:(j + 1) * Bk] = vhat[j]
    s = k @ q / math.sqrt(d)
    w = np.exp(s - s.max())
    p = w / w.sum()
    return p @ v, p, s, k, v


def subsets(n_full, size, must_within=None):
    pool = range(n_full) if must_within is None else sorted(x for x in must_within if 0 <= x < n_full)
    if size > len(pool):
        return []
    return [set(c) for c in itertools.combinations(pool, size)]


def split_errors(q, korig, vorig, khat, vhat, n_len, n_full, Bk, S):
    """The doc's triangle split against the f64 ideal of the promoted set S (docs/bounds.md: key term
    ||sum (p - p~) v||, value term ||sum p~ (v - v~)||), with p~ the softmax of the exact-real scores of what was
    attended (dequantized keys where INT). Returns (key_term, value_term, o_mixed)."""
    d = q.shape[0]
    k0 = np.asarray(korig[:n_len], np.float64)
    v0 = np.asarray(vorig[:n_len], np.float64)
    s0 = k0 @ q / math.sqrt(d)
    p0 = np.exp(s0 - s0.max())
    p0 /= p0.sum()
    o_mixed, pt, _, _, vt = mixed64(q, korig, vorig, khat, vhat, n_len, n_full, Bk, S)
    key_term = np.linalg.norm((p0 - pt) @ v0)
    value_term = np.linalg.norm(pt @ (v0 - vt))
    return key_term, value_term, o_mixed


class Tally:
    def __init__(self, name):
        self.name = name
        self.cases = 0
        self.head_steps = 0
        self.viol = []
        self.notes = []
        self.rungs = [0] * 5

    def bad(self, msg):
        self.viol.append(msg)
        print("VIOLATION", self.name, msg, flush=True)

    def note(self, msg):
        self.notes.append(msg)
        print("NOTE", self.name, msg, flush=True)

    def summary(self):
        return (f"[{PATH}] {self.name}: cases={self.cases} head_steps={self.head_steps} rungs={self.rungs} "
                f"violations={len(self.viol)} notes={len(self.notes)}")


def hot_set_consistent(t: Tally, tag, cache, K64, V64):
    """Every hot slot holds exactly the tier-2 original of its block; tier 2 holds the inputs."""
    ids = np.asarray(cache.hot_ids)
    hk, hv = f64(cache.hot_k), f64(cache.hot_v)
    Bk = cache.block_size
    flushed = np.asarray(cache.flushed)
    for b in range(ids.shape[0]):
        for h in range(ids.shape[1]):
            live = [i for i in ids[b, h] if i >= 0]
            if len(set(live)) != len(live):
                t.bad(f"{tag} b={b} h={h}: duplicate hot ids {ids[b, h]}")
            for s, i in enumerate(ids[b, h]):
                if i < 0:
                    continue
                if i >= flushed[b] // Bk:
                    t.bad(f"{tag} b={b} h={h}: hot block {i} not a full block (flushed {flushed[b]})")
                    continue
                if not (np.array_equal(hk[b, h, s], K64[b, i * Bk:(i + 1) * Bk, h])
                        and np.array_equal(hv[b, h, s], V64[b, i * Bk:(i + 1) * Bk, h])):
                    t.bad(f"{tag} b={b} h={h}: hot slot {s} (block {i}) differs from the originals")
