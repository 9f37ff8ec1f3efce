# ruff: noqa: E402  (the sys.path setup above the imports: run as a script from anywhere)
"""Thirtieth-session soundness audit probe (docs/performance.md, thirtieth session); see README.md here."""

import os as _os
import sys as _sys

_HERE = _os.path.dirname(_os.path.abspath(__file__))
_ROOT = _os.path.abspath(_os.path.join(_HERE, "..", "..", ".."))
for _p in (_ROOT, _os.path.join(_ROOT, "tests"), _os.path.join(_ROOT, "scripts", "soundness_probe"), _HERE):
    if _p not in _sys.path:
        _sys.path.insert(0, _p)
import sys
import time

import audit2
import jax.numpy as jnp
import numpy as np

from certattn_jax.policy import CertPolicy as P

_orig = audit2.draw


def draw(rng, family, B, N, H, G, D, dtype, policy):
    Bk = policy.block_size
    if family == "khuge_qflush":  # per-block key offsets near the dtype max, q' = q/sqrt(d) below TINY
        q, k, v = _orig(rng, "gauss", B, N, H, G, D, dtype, policy)
        off = rng.uniform(0, 3.0e38, size=(B, N // Bk + 1, H, 1))
        k = np.repeat(off, Bk, axis=1)[:, :N] * (1 + 1e-3 * k)
        q = np.abs(q) * 1.1e-38 * np.sqrt(D) * rng.uniform(0.3, 0.99)
        return q, k, v
    if family == "khuge_qsub":  # q entries subnormal (input flushed: DAZ)
        q, k, v = (
            _orig(rng, "khuge_qflush", B, N, H, G, D, dtype, policy)
            if False
            else draw(rng, "khuge_qflush", B, N, H, G, D, dtype, policy)
        )
        q = np.abs(q) / np.abs(q).max() * 1.1e-38
        return q, k, v
    if family == "khuge_qnormal":  # control: the same keys, q' normal (>= 2 TINY)
        q, k, v = draw(rng, "khuge_qflush", B, N, H, G, D, dtype, policy)
        q = np.abs(q) / np.abs(q).min(axis=-1, keepdims=True) * 2.5e-38 * np.sqrt(D)
        q = np.minimum(q, 1e-36)
        return q, k, v
    if family == "val_err_one_block":  # values wide in one block only (its INT error dominates), attention there
        q, k, v = _orig(rng, "gauss", B, N, H, G, D, dtype, policy)
        nbk = max(N // Bk, 1)
        for b in range(B):
            for h in range(H):
                j = rng.integers(nbk)
                v[b, j * Bk : (j + 1) * Bk, h] *= 10 ** rng.uniform(1, 3)
                k[b, j * Bk : (j + 1) * Bk, h] += q[-1, b, h * G] * rng.uniform(0.2, 1.0)
        return q, k, v
    if family == "rank_flip":  # two blocks nearly tied for mass; INT4 key error decides which is heavier
        q, k, v = _orig(rng, "gauss", B, N, H, G, D, dtype, policy)
        nbk = max(N // Bk, 2)
        for b in range(B):
            for h in range(H):
                j1, j2 = rng.choice(nbk, 2, replace=False)
                base = q[-1, b, h * G] / np.linalg.norm(q[-1, b, h * G]) * np.sqrt(D) * 3
                for j in (j1, j2):
                    k[b, j * Bk : (j + 1) * Bk, h] = base + 0.3 * rng.standard_normal((min(Bk, N - j * Bk), D))
                v[b, j1 * Bk : (j1 + 1) * Bk, h] += 5
                v[b, j2 * Bk : (j2 + 1) * Bk, h] -= 5
        return q, k, v
    if family == "tied_exact":
        q, k, v = _orig(rng, "gauss", B, N, H, G, D, dtype, policy)
        k[:] = k[:, :1, :, :]
        return q, k, v
    if family == "block_underflow":  # one block's scores ~200 nats below the rest, huge values there
        q, k, v = _orig(rng, "gauss", B, N, H, G, D, dtype, policy)
        nbk = max(N // Bk, 1)
        for b in range(B):
            for h in range(H):
                j = rng.integers(nbk)
                qh = q[-1, b, h * G]
                k[b, j * Bk : (j + 1) * Bk, h] -= qh / np.linalg.norm(qh) ** 2 * np.sqrt(D) * rng.uniform(80, 250)
                v[b, j * Bk : (j + 1) * Bk, h] *= 1e4 if dtype != jnp.float16 else 1e3
        return q, k, v
    return _orig(rng, family, B, N, H, G, D, dtype, policy)


audit2.draw = draw
f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
CFGS = [
    (2, 2, 2, 32, f32, f32, P(block_size=16, group_size=16, key_bits=8, value_bits=4, k_max=2, eps=0.05), [40, 7]),
    (
        1,
        1,
        8,
        64,
        bf16,
        bf16,
        P(block_size=16, group_size=32, key_bits=4, value_bits=2, k_max=1, eps=0.5, tau_cov=1.0),
        [33],
    ),
    (
        2,
        1,
        1,
        128,
        bf16,
        f32,
        P(block_size=32, group_size=32, key_bits=8, value_bits=4, k_max=1, eps=1e-6, tau_cov=0.5),
        [64, 95],
    ),
]
fams = sys.argv[1].split(",")
T = int(sys.argv[2]) if len(sys.argv) > 2 else 20
cfg_idx = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else range(len(CFGS))
tot = {}
for ci in cfg_idx:
    B, H, G, D, dt, qdt, pol, L0 = CFGS[ci]
    for fam in fams:
        if fam.startswith("khuge") and dt == f16:
            continue
        for seed in range(2):
            t0 = time.time()
            s = audit2.run_config(
                B=B, H=H, G=G, D=D, dtype=dt, qdtype=qdt, policy=pol, L0=L0, T=T, family=fam, seed=seed + 100 * ci
            )
            r = np.asarray(s["ratios"])
            tot.setdefault(fam, [0, 0])
            tot[fam][0] += s["heads"]
            tot[fam][1] += s["viol"]
            print(
                ci,
                fam,
                seed,
                "heads",
                s["heads"],
                "viol",
                s["viol"],
                "rungs",
                s["rungs"],
                "minratio",
                r.min() if r.size else None,
                f"{time.time() - t0:.0f}s",
                s["examples"][:1],
                flush=True,
            )
print("TOTAL", tot)
