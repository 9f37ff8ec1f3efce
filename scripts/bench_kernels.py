"""Pallas tier-1 kernel on the GPU: correctness against its jnp reference, then timing against dense baselines.

LLaMA-3.1-8B layer shapes (32 query heads, 8 KV heads, d = 128), batch 1 and 8, contexts 32K and 128K. All in
one process so every number shares the device state:

  * tier1_split / tier1_block: `pallas_kernels.tier1_pass` (per-split / per-block value accumulators);
    tier1_split_out: the kernel plus the XLA combine to a finished (naive, uncertified) attention output;
  * jax_xla_bf16 (einsum, f32 accumulation), jax_cudnn_bf16 (`jax.nn.dot_product_attention`, cudnn),
    pallas_gqa_bf16 (jax's `decode_attention.gqa`), torch_sdpa_bf16 (torch SDPA replayed from a CUDA graph).

Device timing: each jax variant runs n1 and n2 times inside one jit (`lax.fori_loop`, unrolled by 8, each step
consuming a step-dependent query); the per-call time is (t(n2) - t(n1)) / (n2 - n1), which removes dispatch
and the fixed cost of the call. Median of `--reps`. torch: CUDA-graph replay of n2 calls timed by CUDA events.

    python scripts/bench_kernels.py --out results/bench_kernels.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _device_timing as timing  # noqa: E402
from _device_timing import cudnn_attention, xla_attention  # noqa: E402

from certattn_jax import quant  # noqa: E402
from pallas_kernels import tier1_pass as t1  # noqa: E402

HQ, HKV, D, BK, GS = 32, 8, 128, 64, 32
RESULT: dict = {"rows": [], "checks": [], "errors": []}


def save(path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(RESULT, indent=1))


def log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------- timing


def per_call_us(make_loop, n1: int, n2: int, reps: int) -> float:
    """Median per-call µs of make_loop(n) (n calls in one jit): `_device_timing.per_call_us`."""
    return timing.per_call_us(make_loop, n1, n2, reps)[0]


def measure_bandwidth() -> float:
    return timing.measure_bandwidth(2 << 30)


def torch_sdpa_us(B, T, n) -> float:
    return timing.torch_sdpa_us(B, T, HKV, HQ, D, n)


def jax_loop(step, q0, args):
    """step(q, *args) -> pytree; n calls with q depending on the step index (nothing to hoist)."""

    def make(n):
        @jax.jit
        def run(q0, args):
            def body(i, acc):
                q = (q0.astype(jnp.float32) * (1 + 1e-3 * i.astype(jnp.float32))).astype(q0.dtype)
                out = step(q, *args)
                leaf = jax.tree.leaves(out)[0]
                # carry the whole output: reducing it (even all of it) lets XLA reassociate sum_d p.v into
                # p.(sum_d v) and hoist the value read out of the loop (seen on the H200: "faster" than the floor)
                return acc + jnp.where(jnp.isfinite(leaf), leaf, 0.0).astype(jnp.float32)
            leaf0 = jax.tree.leaves(jax.eval_shape(step, q0, *args))[0]
            return jax.lax.fori_loop(0, n, body, jnp.zeros(leaf0.shape, jnp.float32), unroll=8)

        return lambda: run(q0, args)

    return make




# ---------------------------------------------------------------------------------------------- data
def tier1_inputs(key, B, T, G=HQ // HKV, d=D, key_bits=8, H=HKV):
    """Random tier-1 arrays of T tokens (T // BK full blocks) built on the device without dequantized copies."""
    nb = T // BK
    ks = jax.random.split(key, 8)
    kc = jax.random.randint(ks[0], (B, H, nb, BK, d * key_bits // 8), 0, 256, jnp.int32).astype(jnp.uint8)
    vc = jax.random.randint(ks[1], (B, H, nb, BK, d // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    k_scale = (jax.random.uniform(ks[2], (B, H, nb, d)) * 0.02 + 1e-3).astype(jnp.bfloat16)
    k_zero = (jax.random.normal(ks[3], (B, H, nb, d)) - 1.0).astype(jnp.bfloat16)
    v_scale = (jax.random.uniform(ks[4], (B, H, nb, BK, d // GS)) * 0.2 + 1e-3).astype(jnp.bfloat16)
    v_zero = (jax.random.normal(ks[5], (B, H, nb, BK, d // GS)) - 1.0).astype(jnp.bfloat16)
    q = jax.random.normal(ks[6], (B, H, G, d), jnp.float32)
    n_valid = jnp.full((B,), nb, jnp.int32)
    return q, kc, k_scale, k_zero, vc, v_scale, v_zero, n_valid


def quantized_from_dense(key, B, H, G, nb, d, key_bits, n_valid):
    ks = jax.random.split(key, 3)
    k = jax.random.normal(ks[0], (B, H, nb, BK, d), jnp.float32) * 2
    v = jax.random.normal(ks[1], (B, H, nb, BK, d), jnp.float32)
    kc, kscale, kzero = quant.quantize_keys(k, key_bits)
    vc, vscale, vzero = quant.quantize_values(v, GS, 4)
    q = jax.random.normal(ks[2], (B, H, G, d), jnp.float32)
    return q, kc, kscale, kzero, vc, vscale, vzero, jnp.asarray(n_valid, jnp.int32)


def tier1_bytes(args) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in args[1:7])


# ---------------------------------------------------------------------------------------------- checks
def check_exp_ulps() -> dict:
    """Max error of the kernel's exp (Triton lowering of lax.exp) on [-104, 0], in float32 ulps of the
    correctly rounded result (float64 reference)."""
    from jax.experimental import pallas as pl

    x = jnp.linspace(-104.0, 0.0, 1 << 20, dtype=jnp.float32)

    def k(x_ref, o_ref):
        o_ref[...] = jnp.exp(x_ref[...])

    blk = 1 << 12
    y = pl.pallas_call(k, grid=(x.size // blk,), in_specs=[pl.BlockSpec((blk,), lambda i: (i,))],
                       out_specs=pl.BlockSpec((blk,), lambda i: (i,)),
                       out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32))(x)
    xn = np.asarray(x, np.float64)
    exact = np.exp(xn)
    yn = np.asarray(y, np.float64)
    normal = exact >= np.finfo(np.float32).tiny
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    err_ulp = np.abs(yn - exact)[normal] / ulp[normal]
    sub = ~normal
    return {"max_ulp_normal_range": float(err_ulp.max()), "min_x_normal": float(xn[normal].min()),
            "max_abs_below_normal": float(np.abs(yn - exact)[sub].max()) if sub.any() else 0.0,
            "zero_below_normal": bool(np.all(yn[sub] == 0)) if sub.any() else True}


def check_correctness(variants) -> list[dict]:
    out = []
    cases = [dict(B=2, H=8, G=4, nb=40, d=128, key_bits=8, n_valid=[40, 17]),
             dict(B=3, H=2, G=1, nb=9, d=64, key_bits=8, n_valid=[0, 9, 5]),
             dict(B=1, H=4, G=4, nb=24, d=128, key_bits=4, n_valid=[23])]
    for i, c in enumerate(cases):
        args = quantized_from_dense(jax.random.key(100 + i), c["B"], c["H"], c["G"], c["nb"], c["d"],
                                    c["key_bits"], c["n_valid"])
        for variant, per_block in [(v, pb) for v in variants for pb in (False, True)]:
            kw = dict(group_size=GS, key_bits=c["key_bits"], per_block_acc=per_block, blocks_per_split=4)
            got = t1.tier1_pass(*args, variant=variant, **kw)
            want = t1.tier1_pass_reference(*args, **kw)
            row = dict(case=c, per_block=per_block, variant=variant)
            for name in got._fields:
                g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
                fin = np.isfinite(w)
                row[name] = {"nan": int(np.isnan(g).sum()), "same_nonfinite": bool(np.array_equal(g[~fin], w[~fin])),
                             "max_err_over_max_abs": float(np.max(np.abs(g[fin] - w[fin]), initial=0)
                                                              / max(float(np.max(np.abs(w[fin]), initial=0)), 1e-30))}
            out.append(row)
            log("check", row)
    return out


# ---------------------------------------------------------------------------------------------- ablation
def ablation(mode: str, args, bps: int):
    """Timing-only kernels over the same arrays and grid as tier1_pass (their outputs mean nothing):
    'stream' reads the key and value codes and sums them as integers (loop + memory floor), 'keys' does the
    score half (dequantize-free dot, max, sum-exp), 'values' the value half (unpack, dequantize, dot)."""
    from jax.experimental import pallas as pl

    from pallas_kernels import backend

    q, kc, ks, kz, vc, vs, vz, nv = args
    B, H, G, d = q.shape
    nb = kc.shape[2]
    S = -(-nb // bps)
    ng = d // GS

    def kernel(q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref):
        start = pl.program_id(2) * bps
        stop = jnp.minimum(start + bps, nb)
        qv = q_ref[...]

        def body(n, acc):
            if mode == "stream":
                x = jnp.sum(kc_ref[n, :, :].astype(jnp.int32)) + jnp.sum(vc_ref[n, :, :].astype(jnp.int32))
                return acc + x.astype(jnp.float32)
            if mode == "keys":
                codes = t1._codes_f32(t1._unpack(kc_ref[n, :, :], 8), True)
                s = t1._dot(qv * ks_ref[n, :].astype(jnp.float32)[None, :], codes, 1)
                m = jnp.max(s, axis=1)
                return acc + jnp.sum(jnp.exp(s - m[:, None]), axis=1)[:, None] + m[:, None]
            vcodes = t1._codes_f32(t1._unpack(vc_ref[n, :, :], 4), True).reshape(BK, ng, GS)
            v_hat = (vcodes * vs_ref[n, :, :].astype(jnp.float32)[:, :, None]
                     + vz_ref[n, :, :].astype(jnp.float32)[:, :, None]).reshape(BK, d)
            p = jnp.full((G, BK), 0.5, jnp.float32)
            return acc + t1._dot(p, v_hat, 0)

        init = jnp.zeros((G, 1) if mode == "keys" else (G, d), jnp.float32) if mode != "stream" else jnp.float32(0)
        acc = jax.lax.fori_loop(start, stop, body, init)
        if mode == "stream":
            o_ref[:, :] = jnp.full((G, d), 1.0, jnp.float32) * acc
        else:
            o_ref[:, :] = jnp.broadcast_to(acc, (G, d))

    whole = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, h, s: (b, h) + (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(B, H, S),
        in_specs=[whole(G, d), whole(nb, BK, d), whole(nb, d), whole(nb, d), whole(nb, BK, d // 2),
                  whole(nb, BK, ng), whole(nb, BK, ng)],
        out_specs=pl.BlockSpec((None, None, None, G, d), lambda b, h, s: (b, h, s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, H, S, G, d), jnp.float32),
        compiler_params=backend.compiler_params(4, 2), interpret=backend.interpret())(q, kc, ks, kz, vc, vs, vz)


# ---------------------------------------------------------------------------------------------- baselines
def dense_inputs(key, B, T):
    ks = jax.random.split(key, 3)
    q = jax.random.normal(ks[0], (B, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.bfloat16)
    return q, k, v








# ---------------------------------------------------------------------------------------------- main
def bench_shape(B, T, n1, n2, reps, bw, bps_list, quick, variants, warps, no_baselines=False, ablate=False):
    G = HQ // HKV
    rows = []

    def add(impl, us, nbytes, **extra):
        row = dict(impl=impl, context=T, batch=B, median_us=round(us, 2), bytes=nbytes,
                   floor_us=round(nbytes / bw * 1e6, 2), **extra)
        rows.append(row)
        RESULT["rows"].append(row)
        log(row)

    def attempt(name, fn):
        timing.attempt(RESULT, name, T, B, fn)

    args = tier1_inputs(jax.random.key(T + B), B, T)
    nbytes_t1 = tier1_bytes(args)
    q0, rest = args[0], args[1:]
    configs = [(v, False, bps, w) for v in variants for bps in bps_list for w in warps]
    configs += [(v, True, bps_list[0], warps[0]) for v in variants]
    for variant, per_block, bps, nw in configs:
        def run_t1(variant=variant, per_block=per_block, bps=bps, nw=nw):
            step = lambda q, *r: t1.tier1_pass(q, *r, group_size=GS, per_block_acc=per_block,  # noqa: E731
                                               blocks_per_split=bps, variant=variant, num_warps=nw)
            us = per_call_us(jax_loop(step, q0, rest), n1, n2, reps)
            nb = T // BK
            bps_used = bps or t1.default_blocks_per_split(B, HKV, nb)
            S = -(-nb // bps_used)
            out_bytes = B * HKV * G * (2 * nb + (nb * D if per_block else S * (D + 1))) * 4
            add("tier1_block" if per_block else "tier1_split", us, nbytes_t1 + out_bytes, variant=variant,
                blocks_per_split=bps_used, num_warps=nw)
        attempt(f"tier1_{variant}", run_t1)
    if not quick:
        def run_out():
            step = lambda q, *r: t1.naive_output(t1.tier1_pass(q, *r, group_size=GS, variant=variants[0],  # noqa: E731
                                                               blocks_per_split=bps_list[0], num_warps=warps[0]))
            add("tier1_split_out", per_call_us(jax_loop(step, q0, rest), n1, n2, reps), nbytes_t1)
        attempt("tier1_split_out", run_out)
    if ablate:
        bps_used = bps_list[0] or t1.default_blocks_per_split(B, HKV, T // BK)
        for mode in ("stream", "keys", "values"):
            def run_abl(mode=mode):
                step = lambda q, *r: ablation(mode, (q, *r), bps_used)  # noqa: E731
                add(f"ablation_{mode}", per_call_us(jax_loop(step, q0, rest), n1, n2, reps), nbytes_t1,
                    blocks_per_split=bps_used)
            attempt(f"ablation_{mode}", run_abl)
    args = rest = None  # free the device arrays before the dense ones
    if no_baselines:
        return rows
    q, k, v = dense_inputs(jax.random.key(7 + T + B), B, T)
    dense_bytes = 2 * k.size * 2
    attempt("jax_xla_bf16", lambda: add("jax_xla_bf16", per_call_us(jax_loop(xla_attention, q, (k, v)), n1, n2,
                                                                     reps), dense_bytes))
    attempt("jax_cudnn_bf16", lambda: add("jax_cudnn_bf16", per_call_us(jax_loop(cudnn_attention, q, (k, v)), n1,
                                                                         n2, reps), dense_bytes))

    def run_gqa():
        from jax.experimental.pallas.ops.gpu import decode_attention

        for ks in (128,):
            step = lambda q, k, v, ks=ks: decode_attention.gqa(q, k, v, k_splits=ks)  # noqa: E731
            add("pallas_gqa_bf16", per_call_us(jax_loop(step, q, (k, v)), n1, n2, reps), dense_bytes, k_splits=ks)
    attempt("pallas_gqa_bf16", run_gqa)
    q = k = v = None
    attempt("torch_sdpa_bf16", lambda: add("torch_sdpa_bf16", torch_sdpa_us(B, T, n2), dense_bytes))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="compile + correctness + one small timing")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="1x32768,1x131072,8x32768,8x131072")
    ap.add_argument("--bps", default="0", help="comma list of blocks per split (0 = default heuristic)")
    ap.add_argument("--variants", default="dot", help="comma list of tier-1 kernel variants")
    ap.add_argument("--warps", default="4", help="comma list of num_warps")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--ablate", default="", help="comma list of shapes (BxT) to run the ablation kernels at")
    ap.add_argument("--no-checks", action="store_true")
    a = ap.parse_args()
    RESULT.update(timing.run_info(), interpret=bool(os.environ.get("CERTATTN_PALLAS_INTERPRET")))
    t0 = time.perf_counter()
    RESULT["exp_check"] = check_exp_ulps()
    log("exp", RESULT["exp_check"])
    variants = a.variants.split(",")
    RESULT["checks"] = [] if a.no_checks else check_correctness(variants)
    save(a.out)
    bw = measure_bandwidth()
    RESULT["measured_bandwidth_Bps"] = bw
    log("bandwidth GB/s", bw / 1e9)
    bps_list = [int(x) or None for x in a.bps.split(",")]
    for shape in a.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        n1, n2 = (4, 20) if a.quick else (8, 40)
        bench_shape(B, T, n1, n2, a.reps, bw, bps_list, a.quick, variants, [int(w) for w in a.warps.split(",")],
                    a.no_baselines, ablate=shape in a.ablate.split(","))
        save(a.out)
    RESULT["wall_s"] = time.perf_counter() - t0
    save(a.out)
    log("done in", RESULT["wall_s"])


if __name__ == "__main__":
    main()
