"""Where the compiled `int_kv` tier-1 kernel goes wrong on the GPU (issue 8's kernels, soundness first).

The H200 run of 2026-12-01 (results/gpu_2026-12-01_kernels.log) failed three `int_kv` tests: the value sums `acc`
came back ~2x the reference while the scores (m, l) were right. The value dot of `_int_value_sum` contracts the
block's Bk tokens (Bk = 16 in those tests); the scores' dot contracts d >= 64. Hypothesis: Triton's int8 MMA
with a contraction shorter than the instruction's (k = 32 for int8) is wrong. Confirmed by this probe's first
run (results/probe_int_dot_h200.log: K = 16 int8 dots return exactly 2x, K >= 32 and float32 are exact); the
kernel now contracts fewer than 32 terms in float32 (`tier1_pass.MIN_INT8_CONTRACTION`). This probe checks,
compiled:

  1. bare int8 x int8 -> int32 `dot_general`s in a one-program kernel, for each contraction layout and
     K in {16, 32, 64, 128}, against numpy's exact integer product; float32 HIGHEST dots of the same integers;
  2. the whole `tier1_pass` per variant against `tier1_pass_reference` over block sizes, query heads, head
     dims, key bits and both accumulator layouts.

    python3 scripts/probe_int_dot.py --out results/probe_int_dot_h200.json      # on the device
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from pallas_kernels import backend  # noqa: E402
from pallas_kernels.tier1_pass import Tier1Partials, tier1_pass, tier1_pass_reference  # noqa: E402

LAYOUTS = {"a.T b": ((0,), (0,)), "a b": ((1,), (0,)), "a b.T": ((1,), (1,))}


def bare_dot(layout: str, M: int, N: int, K: int, dtype) -> dict:
    ca, cb = LAYOUTS[layout]
    rng = np.random.default_rng(K * 7 + M + N)
    a = rng.integers(-65, 66, size=(M, K)).astype(np.int32)
    b = rng.integers(-8, 8, size=(K, N)).astype(np.int32)
    a_in = a.T if ca == (0,) else a
    b_in = b.T if cb == (1,) else b
    out_t = jnp.int32 if dtype == jnp.int8 else jnp.float32

    def kernel(a_ref, b_ref, o_ref):
        prec = None if dtype == jnp.int8 else jax.lax.Precision.HIGHEST
        o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], ((ca, cb), ((), ())), precision=prec,
                                         preferred_element_type=out_t)

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((M, N), out_t),
                         interpret=backend.interpret())(jnp.asarray(a_in, dtype), jnp.asarray(b_in, dtype))
    got = np.asarray(got).astype(np.int64)
    want = a.astype(np.int64) @ b.astype(np.int64)
    return {"layout": layout, "dtype": jnp.dtype(dtype).name, "M": M, "N": N, "K": K,
            "exact": bool((got == want).all()), "ratio_median": float(np.median(got[want != 0] / want[want != 0]))}


def _inputs(seed, B, H, G, nb, Bk, d, n_valid, key_bits, gs):
    from certattn_jax import quant

    rng = np.random.default_rng(seed)
    k = rng.normal(size=(B, H, nb, Bk, d)) * rng.uniform(0.5, 3.0, size=(1, 1, 1, 1, d))
    v = rng.normal(size=(B, H, nb, Bk, d)) + rng.normal(size=(1, H, 1, 1, d))
    kc, ks, kz = quant.quantize_keys(jnp.asarray(k, jnp.float32), key_bits)
    vc, vs, vz = quant.quantize_values(jnp.asarray(v, jnp.float32), gs, 4)
    q = jnp.asarray(rng.normal(size=(B, H, G, d)) * 2.0, jnp.float32)
    return q, kc, ks, kz, vc, vs, vz, jnp.asarray(n_valid, jnp.int32)


def rel_errors(got: Tier1Partials, want: Tier1Partials) -> dict:
    out = {}
    for name in ("m", "l", "acc", "acc_m"):
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        fin = np.isfinite(w)
        scale = max(float(np.max(np.abs(w[fin]), initial=0.0)), 1e-30)
        bad_inf = bool((g[~fin] != w[~fin]).any()) or bool(np.isnan(g).any())
        out[name] = float("inf") if bad_inf else float(np.max(np.abs(g[fin] - w[fin]), initial=0.0) / scale)
    return out


def kernel_case(variant, Bk, G, d, key_bits, per_block, gs=32) -> dict:
    args = _inputs(Bk + G + d, 2, 2, G, 5, Bk, d, [5, 2], key_bits, gs)
    kw = dict(group_size=gs, blocks_per_split=2, key_bits=key_bits, per_block_acc=per_block)
    try:
        err = rel_errors(tier1_pass(*args, variant=variant, **kw), tier1_pass_reference(*args, **kw))
    except Exception as e:  # noqa: BLE001 - a probe reports every failure
        err = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    row = dict(variant=variant, Bk=Bk, G=G, d=d, key_bits=key_bits, per_block=per_block,
               gs=gs, **err)
    row["ok"] = "error" not in err and max(err.values()) < 3e-5
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results/probe_int_dot.json"))
    ap.add_argument("--quick", action="store_true", help="a few cases (CPU)")
    args = ap.parse_args()
    bare = []
    for layout, K, dtype in itertools.product(LAYOUTS, (16, 32, 64, 128), (jnp.int8, jnp.float32)):
        if args.quick and K > 32:
            continue
        try:
            bare.append(bare_dot(layout, 16, 32, K, dtype))
        except Exception as e:  # noqa: BLE001
            bare.append({"layout": layout, "K": K, "dtype": jnp.dtype(dtype).name, "error": str(e)[:200]})
        print(json.dumps(bare[-1]), flush=True)
    rows = []
    grid = itertools.product(("int_kv", "int_keys"), (16, 32, 64), (3, 4), (64, 128), (4, 8),
                             (False, True))
    for variant, Bk, G, d, kb, per_block in grid:
        if args.quick and (Bk > 16 or d > 64 or variant != "int_kv"):
            continue
        if not args.quick and (d, kb) != (128, 8) and (variant != "int_kv" or G != 4 or per_block or Bk == 32):
            continue  # other head dims and key widths: one layout each
        if variant == "int_keys" and per_block:
            continue
        if variant != "int_kv" and (G != 4 or d != 128 or kb != 8):
            continue
        rows.append(kernel_case(variant, Bk, G, d, kb, per_block))
        print(json.dumps(rows[-1]), flush=True)
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "interpret": backend.interpret(),
           "bare_dots": bare, "tier1_cases": rows,
           "failing_cases": [r for r in rows if not r["ok"]]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")  # (the log has every row as it comes)
    print(f"bare dots inexact: {[b for b in bare if not b.get('exact')]}")
    print(f"tier-1 cases failing: {len(res['failing_cases'])} of {len(rows)}")


if __name__ == "__main__":
    main()
