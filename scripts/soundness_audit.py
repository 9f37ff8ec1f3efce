"""A hostile soundness audit of certified attention (slower and broader than the test suite).

Decodes token by token like the model does (write_token -> certified_attention_step -> flush) with float32
inputs written into f32 / bf16 / f16 caches, at 8/4, 4/4 and 4/2 bits, with data families mixing extreme
magnitudes (scores to ~1e10, values 1e-25..1e30), offsets, needles, outlier channels and NaN/Inf; every head of
every step is checked against a float64 reference over exactly what the cache stores. Prints one line per
configuration and a summary; exits 1 on any violation (error > bound, a NaN bound, a finite bound on a
non-finite output, or a certified head on NaN/Inf data).

    python scripts/soundness_audit.py --cases 40 --out results/soundness_audit.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from certattn_jax.attention import certified_attention_step
from certattn_jax.cache import TieredKVCache
from certattn_jax.policy import CertPolicy

LAYOUTS = [  # (dtype, policy)
    (jnp.float32, CertPolicy(block_size=16, group_size=16, key_bits=8, value_bits=4, k_max=3)),
    (jnp.bfloat16, CertPolicy(block_size=16, group_size=16, key_bits=4, value_bits=4, k_max=2, eps=0.3)),
    (jnp.float16, CertPolicy(block_size=8, group_size=16, key_bits=4, value_bits=2, k_max=4, eps=1.0)),
    (jnp.bfloat16, CertPolicy(block_size=32, group_size=32, key_bits=8, value_bits=2, k_max=2, v_max=2)),
]
B, H, G, D, CAP = 2, 2, 2, 32, 160
FAMILIES = ("gauss", "needle", "huge_scores", "tiny_values", "huge_values", "offset", "outlier", "nonfinite")
# Opt-in (`--families`; the default list keeps earlier seeds reproducible): "midpoint" puts every key between its
# block's extremes at the middle of two INT8/INT4 levels (the quantizer's largest rounding error on every element,
# the case where Delta's |error| <= s/2 is tight), "value_outlier" one channel per value group and token 10^2-10^4
# times the others (INT4 then zeroes the rest of the group: the largest per-token value error eta can meet).
# "subnormal" (twentieth session): values, and in half the cases keys, at float32's subnormal / smallest normal
# magnitudes (1e-45..1e-36, where squares and products underflow or are flushed); "magnitude_mix": every token's
# value vector at its own magnitude between 1e-40 and 1e30 (one vector's entries spanning the whole range).
EXTRA_FAMILIES = ("midpoint", "value_outlier", "subnormal", "magnitude_mix")


@functools.partial(jax.jit, static_argnames=("policy",), donate_argnums=0)
def decode_step(cache, k, v, q, policy):
    cache = cache.flush().write_token(k, v)
    out, cert, cache = certified_attention_step(q, cache, policy)
    return cache, out, cert


def _midpoint_keys(rng, k, block: int, bits: int):
    """k [B, T, H, d] with every key strictly inside its block's per-channel range moved to the middle between two
    quantization levels of that block (levels from the block's own min / max, as the quantizer computes them)."""
    levels = (1 << bits) - 1
    for start in range(0, k.shape[1], block):
        blk = k[:, start:start + block]
        lo, hi = blk.min(axis=1, keepdims=True), blk.max(axis=1, keepdims=True)
        step = (hi - lo) / levels
        m = rng.integers(0, levels, size=blk.shape)
        mid = lo + (m + 0.5) * step
        inner = (blk > lo) & (blk < hi)
        k[:, start:start + block] = np.where(inner, mid, blk)
    return k


def draw(rng, family, T, policy=None):
    k = rng.standard_normal((B, T, H, D))
    v = rng.standard_normal((B, T, H, D))
    q = rng.standard_normal((T, B, H * G, D)) * 10 ** rng.uniform(-2, 1)
    if family == "needle":
        for b in range(B):
            idx = rng.integers(T, size=2)
            k[b, idx] *= 6
    elif family == "huge_scores":
        k *= 10 ** rng.uniform(2, 5)
        q *= 10 ** rng.uniform(1, 4)
    elif family == "tiny_values":
        v *= 10 ** rng.uniform(-25, -15)
    elif family == "huge_values":
        v *= 10 ** rng.uniform(15, 30)
    elif family == "offset":
        v = 10 ** rng.uniform(0, 4) + v * 10 ** rng.uniform(-4, 0)
        k = k + rng.uniform(-50, 50)
    elif family == "outlier":
        k[..., rng.integers(D)] *= 10 ** rng.uniform(1, 3)
    elif family == "midpoint":
        k = _midpoint_keys(rng, k, policy.block_size, policy.key_bits)
    elif family == "value_outlier":
        g = policy.group_size
        for j in range(D // g):
            ch = j * g + rng.integers(g, size=(B, T, H))
            np.put_along_axis(v, ch[..., None], np.take_along_axis(v, ch[..., None], axis=-1)
                              * 10 ** rng.uniform(2, 4), axis=-1)
    elif family == "subnormal":
        v *= 10 ** rng.uniform(-45, -36)
        if rng.random() < 0.5:
            k *= 10 ** rng.uniform(-45, -36)
    elif family == "magnitude_mix":
        v *= 10 ** rng.uniform(-40, 30, size=(B, T, H, 1))
        v[..., rng.integers(D)] *= 10 ** rng.uniform(-40, 0)
    elif family == "nonfinite":
        k[rng.integers(B), rng.integers(T), rng.integers(H), rng.integers(D)] = rng.choice([np.nan, np.inf, 1e6])
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def reference(q, k, v, n):
    """q [B, Hq, d] float64; k, v [B, n, H, d] float64 -> [B, Hq, d]."""
    out = np.empty(q.shape)
    for b in range(B):
        for h in range(H * G):
            s = k[b, :n, h // G] @ q[b, h] / math.sqrt(D)
            w = np.exp(s - np.max(s))
            out[b, h] = (w @ v[b, :n, h // G]) / np.sum(w)
    return out


def audit_case(layout: int, family: str, seed: int, T: int) -> dict:
    dtype, policy = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    q, k, v = draw(rng, family, T, policy)
    ks = np.asarray(jnp.asarray(k).astype(dtype).astype(jnp.float32), np.float64)
    vs = np.asarray(jnp.asarray(v).astype(dtype).astype(jnp.float32), np.float64)
    cache = TieredKVCache.init(batch=B, capacity=CAP, num_kv_heads=H, head_dim=D, dtype=dtype, policy=policy)
    stats = {"violations": 0, "heads": 0, "ratios": [], "rungs": [0] * 5, "examples": []}
    for t in range(T):
        cache, out, cert = decode_step(cache, jnp.asarray(k[:, t:t + 1]), jnp.asarray(v[:, t:t + 1]),
                                       jnp.asarray(q[t]), policy)
        if t % 5 and t != T - 1:
            continue
        c = jax.tree.map(np.asarray, cert)
        bound = c.error_bound.astype(np.float64)
        with np.errstate(all="ignore"):
            ref = reference(q[t].astype(np.float64), ks, vs, t + 1)
            err = np.linalg.norm(np.asarray(out, np.float64) - ref, axis=-1)
        finite_kv = np.all(np.isfinite(ks[:, :t + 1]), axis=(1, 3)) & np.all(np.isfinite(vs[:, :t + 1]), axis=(1, 3))
        bad_data = ~np.repeat(finite_kv, G, axis=1)  # [B, Hq]: query head h reads KV head h // G
        out_bad = ~np.all(np.isfinite(np.asarray(out, np.float64)), axis=-1)
        viol = (np.isnan(bound) | (~bad_data & ~out_bad & ~(err <= bound)) | (out_bad & np.isfinite(bound))
                | (bad_data & c.certified))
        stats["heads"] += bound.size
        for r in range(5):
            stats["rungs"][r] += int(np.sum(c.rung == r))
        fin = np.isfinite(bound) & (err > 0) & ~bad_data
        stats["ratios"] += (bound[fin] / err[fin]).tolist()
        if viol.any():
            stats["violations"] += int(viol.sum())
            b, h = map(int, np.argwhere(viol)[0])
            stats["examples"].append({"t": t, "b": b, "h": h, "err": float(err[b, h]), "bound": float(bound[b, h]),
                                      "rung": int(c.rung[b, h]), "e_key": float(c.e_key[b, h]),
                                      "e_val": float(c.e_val[b, h]), "e_num": float(c.e_num[b, h])})
    return stats


def _quantiles(ratios: list[float]) -> dict[str, float]:
    """bound / true error quantiles (heads with a finite bound and a non-zero error)."""
    r = np.asarray(ratios)
    if not r.size:
        return {}
    return {name: float(np.quantile(r, x)) for name, x in (("p10", .1), ("median", .5), ("p90", .9))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", type=int, default=16, help="random cases per layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma list of data families (default the original eight; extra: {','.join(EXTRA_FAMILIES)})")
    args = p.parse_args(argv)
    families = tuple(args.families.split(","))
    unknown = set(families) - set(FAMILIES + EXTRA_FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose from {FAMILIES + EXTRA_FAMILIES}")
    rng = np.random.default_rng(args.seed)
    total = {"violations": 0, "heads": 0, "rungs": [0] * 5, "ratios": [], "cases": 0, "failures": []}
    per_family: dict[str, dict] = {}
    t0 = time.time()
    for layout in range(len(LAYOUTS)):
        for _ in range(args.cases):
            family = str(rng.choice(families))
            seed = int(rng.integers(2 ** 31))
            T = int(rng.integers(20, CAP))
            s = audit_case(layout, family, seed, T)
            total["cases"] += 1
            total["heads"] += s["heads"]
            total["violations"] += s["violations"]
            total["rungs"] = [a + b for a, b in zip(total["rungs"], s["rungs"], strict=True)]
            total["ratios"] += s["ratios"]
            fam = per_family.setdefault(family, {"heads": 0, "violations": 0, "rungs": [0] * 5, "ratios": []})
            fam["heads"] += s["heads"]
            fam["violations"] += s["violations"]
            fam["rungs"] = [a + b for a, b in zip(fam["rungs"], s["rungs"], strict=True)]
            fam["ratios"] += s["ratios"]
            if s["violations"]:
                total["failures"].append({"layout": layout, "family": family, "seed": seed, "T": T,
                                          "examples": s["examples"][:3]})
                print(f"VIOLATION layout={layout} family={family} seed={seed} T={T}: {s['examples'][:2]}",
                      flush=True)
        print(f"layout {layout} done: {total['heads']} head-steps, {total['violations']} violations, "
              f"{time.time() - t0:.0f} s", flush=True)
    total["tightness"] = _quantiles(total.pop("ratios"))
    for fam in per_family.values():
        fam["tightness"] = _quantiles(fam.pop("ratios"))
    total["per_family"] = per_family
    print(json.dumps({k: v for k, v in total.items() if k not in ("failures", "per_family")}))
    for name, fam in sorted(per_family.items()):
        print(f"  {name:12s} heads {fam['heads']:6d} violations {fam['violations']} rungs {fam['rungs']} "
              f"bound/error {fam['tightness']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, **total}, f, indent=1)
    return 1 if total["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
