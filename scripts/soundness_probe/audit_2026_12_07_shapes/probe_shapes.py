"""Single-layer certified decoding over head_dim / GQA / KV-head / block / group / bit / dtype shapes that earlier
audits did not cover (they used d 16, G 2, H 2, group 16), with benign and adversarial data (shape_common.FAMILIES).

A TieredKVCache is built from a ragged prefix (a row shorter than one block, one at a block boundary, one with a
partial residual block), then decoded token by token: jitted flush().write_token(k, v) (cache donated), then jitted
certified_attention_step. Every head-step goes through check_any.check_step_any (error <= bound against float64
numpy over the stored originals, and the certificate-field checks), hot_set_consistent and ratio_and_nan; the
cache's invariants are checked after every flush and at the end.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_shapes/probe_shapes.py [--cfgs a,b] [--fams x,y]
        [--steps N] [--long N] [--compiled-shapes] [--groups]
    kernel path: CERTATTN_TIER1=pallas CERTATTN_RUNG0=fused CERTATTN_FETCH_KERNEL=1 CERTATTN_WRITE_KERNEL=1 <same>

--compiled-shapes: make pallas_kernels.backend.supports_sizes answer as it does for compiled kernels (powers of
two only) while the kernels still run interpreted: the non-power-of-two shapes then take the library's fallback.
--groups: the value-group sweep (every group size the library accepts for d 64, 80, 96, 128) instead of CONFIGS.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from shape_common import (  # noqa: E402
    FAMILIES,
    PATH,
    ShapeTally,
    cache_invariants,
    check_step_any,
    family,
    hot_set_consistent,
    lengths_for,
    ratio_and_nan,
    stored,
)

ap = argparse.ArgumentParser()
ap.add_argument("--cfgs", default="")
ap.add_argument("--fams", default="")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--long", type=int, default=0, help="steps of an extra long gauss run (crosses several flushes)")
ap.add_argument("--compiled-shapes", action="store_true")
ap.add_argument("--groups", action="store_true")
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()

if args.compiled_shapes:
    from pallas_kernels import backend as _backend

    _backend.supports_sizes = lambda *sizes: all(n > 0 and n & (n - 1) == 0 for n in sizes)

from certattn_jax import step as step_mod  # noqa: E402
from certattn_jax.attention import certified_attention_step  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402


@functools.partial(jax.jit, donate_argnums=0)
def write(cache, k, v):
    return cache.flush().write_token(k, v)


attend = jax.jit(certified_attention_step)
BF, F16 = jnp.bfloat16, jnp.float16

# name: (d, G, H, Bk, group, key_bits, value_bits, dtype, B, k_max, hot_slots, eps)
CONFIGS = {
    "d64_G1_H3_b16_g16_k8v4_bf16_B3": (64, 1, 3, 16, 16, 8, 4, BF, 3, 2, 0, 0.05),
    "d64_G8_H1_b32_g64_k4v2_f16_B3_hot3": (64, 8, 1, 32, 64, 4, 2, F16, 3, 2, 3, 0.05),
    "d80_G3_H1_b16_g5_k8v4_bf16_B3": (80, 3, 1, 16, 5, 8, 4, BF, 3, 2, 0, 0.02),
    "d80_G4_H3_b32_g16_k8v4_f16_B1_hot4": (80, 4, 3, 32, 16, 8, 4, F16, 1, 2, 4, 0.05),
    "d80_G1_H8_b16_g80_k4v2_bf16_B3": (80, 1, 8, 16, 80, 4, 2, BF, 3, 2, 0, 0.05),
    "d96_G3_H3_b16_g32_k8v4_f16_B3": (96, 3, 3, 16, 32, 8, 4, F16, 3, 2, 0, 5e-3),
    "d96_G8_H1_b128_g96_k8v4_bf16_B3": (96, 8, 1, 128, 96, 8, 4, BF, 3, 1, 0, 0.05),
    "d96_G4_H1_b16_g3_k4v2_bf16_B1_hot3": (96, 4, 1, 16, 3, 4, 2, BF, 1, 1, 3, 0.05),
    "d128_G3_H1_b16_g128_k8v4_bf16_B3": (128, 3, 1, 16, 128, 8, 4, BF, 3, 2, 0, 0.05),
    "d128_G8_H8_b16_g32_k8v4_bf16_B1": (128, 8, 8, 16, 32, 8, 4, BF, 1, 2, 0, 0.05),
    "d128_G1_H3_b128_g64_k4v2_f16_B3": (128, 1, 3, 128, 64, 4, 2, F16, 3, 1, 0, 0.05),
    "d128_G4_H1_b32_g2_k8v4_f16_B3_hot5": (128, 4, 1, 32, 2, 8, 4, F16, 3, 2, 5, 1e-3),
    "d64_G3_H8_b128_g8_k8v4_f16_B1": (64, 3, 8, 128, 8, 8, 4, F16, 1, 1, 0, 0.05),
    "d96_G1_H1_b32_g12_k4v2_f16_B3_exact": (96, 1, 1, 32, 12, 4, 2, F16, 3, 2, 0, 0.0),
}


def group_sweep():
    """Every value group size the library accepts (quant.check_group_size: a divisor >= 2 of d), small shapes."""
    out = {}
    i = 0
    for d in (64, 80, 96, 128):
        for g in [x for x in range(2, d + 1) if d % x == 0]:
            kb, vb = (8, 4) if i % 2 == 0 else (4, 2)
            dt = BF if i % 3 else F16
            G = (1, 3, 4)[i % 3]
            out[f"grp_d{d}_g{g}_k{kb}v{vb}_{jnp.dtype(dt).name}_G{G}"] = (d, G, 1, 16, g, kb, vb, dt, 3, 2, 0, 0.02)
            i += 1
    return out


def run_case(t, cname, cfg, fam, steps, seed):
    d, G, H, Bk, grp, kb, vb, dt, B, kmax, hot, eps = cfg
    rng = np.random.default_rng(seed)
    L0 = lengths_for(B, Bk)
    T = int(L0.max()) + steps
    Kr, Vr, Q = family(fam, rng, B, T, H, G, d, Bk, steps, dt)
    K = stored(Kr, dt).astype(np.float64)
    V = stored(Vr, dt).astype(np.float64)
    pol = CertPolicy(block_size=Bk, group_size=grp, key_bits=kb, value_bits=vb, k_max=kmax, v_max=2, hot_slots=hot,
                     eps=eps, **(dict(abs_tol=0.0, layer_fallback_fraction=2.0) if eps == 0.0 else {}))
    P = int(L0.max())
    pre_k = np.zeros((B, P, H, d), np.float32)
    pre_v = np.zeros_like(pre_k)
    for b in range(B):
        pre_k[b, :L0[b]] = K[b, :L0[b]]
        pre_v[b, :L0[b]] = V[b, :L0[b]]
    cap = ((P + steps) // Bk + 2) * Bk
    cache = TieredKVCache.from_dense(jnp.asarray(pre_k, dt), jnp.asarray(pre_v, dt), policy=pol, capacity=cap,
                                     lengths=jnp.asarray(L0, jnp.int32))
    lens = L0.copy()
    t.cases += 1
    t.extreme = fam.startswith("extreme")
    worst = 0.0
    for s in range(steps):
        kt = np.zeros((B, 1, H, d), np.float32)
        vt = np.zeros_like(kt)
        for b in range(B):
            kt[b, 0] = K[b, lens[b]]
            vt[b, 0] = V[b, lens[b]]
        flushed_before = np.asarray(cache.flushed).copy()
        cache = write(cache, jnp.asarray(kt, dt), jnp.asarray(vt, dt))
        lens = lens + 1
        tag = f"{cname}/{fam}/step{s}"
        if not np.array_equal(np.asarray(cache.flushed), flushed_before):
            cache_invariants(t, tag + "/after-flush+write", cache, K, V, lens, maintained=False)
        qj = jnp.asarray(Q[s], dt)
        o, cert, new = attend(qj, cache, pol)
        t.out_ulp = float(np.nanmax(np.abs(np.asarray(o, np.float32)), initial=0.0)) * float(jnp.finfo(dt).eps)
        check_step_any(t, tag, qj, cache, new, o, cert, pol, K, V, lens, 0)
        hot_set_consistent(t, tag, new, K, V)
        worst = max(worst, ratio_and_nan(t, tag, o, cert, K, V, lens, qj))
        cache = new
    cache_invariants(t, f"{cname}/{fam}/end", cache, K, V, lens, maintained=False)
    t.extreme = False
    return worst, cache, pol


def main():
    t0 = time.time()
    cfgs = group_sweep() if args.groups else CONFIGS
    pick = [c for c in args.cfgs.split(",") if c]
    fams = [f for f in args.fams.split(",") if f] or list(FAMILIES)
    total = dict(hs=0, viol=0, worst=0.0, worst_where=None)
    lines = []
    for ci, (cname, cfg) in enumerate(cfgs.items()):
        if pick and cname not in pick:
            continue
        t = ShapeTally(f"single/{cname}")
        worst = 0.0
        path_info = None
        for fi, fam in enumerate(fams):
            try:
                w, cache, pol = run_case(t, cname, cfg, fam, args.steps, args.seed + 1000 * ci + fi)
            except Exception as e:  # a refusal (or a crash) is reported, not hidden
                msg = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  REFUSED/ERROR {cname}/{fam}: {msg}", flush=True)
                t.note(f"{cname}/{fam}: exception {msg}")
                break
            if path_info is None:
                path_info = (f"tier1 kernel={step_mod.tier1_kernel_runs(cache, pol.tier1)} "
                             f"fused rung0={step_mod.uses_fused_rung0(cache, pol)}")
            worst = max(worst, w)
            print(f"  {cname}/{fam}: head_steps {t.head_steps} rungs {t.rungs} viol {len(t.viol)} "
                  f"err/bound {w:.3g} ({time.time() - t0:.0f}s)", flush=True)
        if args.long and path_info is not None:
            w, _, _ = run_case(t, cname, cfg, "gauss", args.long, args.seed + 1000 * ci + 99)
            worst = max(worst, w)
            print(f"  {cname}/gauss-long{args.long}: head_steps {t.head_steps} rungs {t.rungs} viol {len(t.viol)} "
                  f"err/bound {w:.3g} ({time.time() - t0:.0f}s)", flush=True)
        line = t.summary() + f" max_err/bound={worst:.4g} ambiguous_sets={t.ambiguous} [{path_info}]"
        print(line, flush=True)
        lines.append(line)
        total["hs"] += t.head_steps
        total["viol"] += len(t.viol)
        if worst > total["worst"]:
            total["worst"], total["worst_where"] = worst, getattr(t, "worst", None)
    print("=== SUMMARY", PATH, "compiled-shapes emulated:", args.compiled_shapes)
    print("\n".join(lines))
    print(f"TOTAL [{PATH}] head_steps={total['hs']} violations={total['viol']} max_err/bound={total['worst']:.4g} "
          f"at {total['worst_where']} {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
