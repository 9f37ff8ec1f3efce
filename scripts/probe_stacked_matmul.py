"""The stacked-weight GEMM kernel against XLA's GEMMs on per-layer buffers (docs/performance.md).

    PYTHONPATH=. python scripts/probe_stacked_matmul.py --out results/probe_stacked_matmul.json

For each decode GEMM of a model shape (the fused q|k|v, o, gate|up and down projections) and each batch M, one
jitted program multiplies x by every layer's weight in turn, `--reps` times over the layers (so the weights
stream from HBM, not L2), in these forms:
  xla_layers    jnp.matmul on 32 separate per-layer buffers (the unrolled model's GEMMs: cuBLAS / Triton GEMM)
  xla_stacked   jnp.matmul on w[i] of the stacked array inside a fori_loop (XLA copies the slice first)
  pallas[...]   `pallas_kernels.stacked_matmul` on the stacked array inside a fori_loop, per tiling
Each row: microseconds per GEMM (median of --repeats calls, device-timed around the whole call), the weight
bytes per GEMM, the bandwidth that implies, and for the kernel the largest error against a float64 product
relative to the largest |output| (bf16 output rounding is ~4e-3).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.stacked_matmul import default_tiling, stacked_matmul  # noqa: E402

SHAPES = {  # name -> (layers, {gemm: (K, N)})
    "llama3.1-8b": (32, {"wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 28672),
                         "w_down": (14336, 4096)}),
    "smollm2": (30, {"wqkv": (576, 960), "wo": (576, 576), "w_gate_up": (576, 3072), "w_down": (1536, 576)}),
}


def timed(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _each_layer_buffer(reps, x, ws):
    """reps passes of x @ w for each per-layer buffer w (unrolled: XLA's GEMMs read each buffer in place)."""
    def rep(_, acc):
        for wi in ws:
            acc = acc + jnp.matmul(x, wi)[:, :1].astype(jnp.float32)
        return acc
    return jax.lax.fori_loop(0, reps, rep, jnp.zeros((x.shape[0], 1), jnp.float32))


def _kernel_gemm(tiling, x, w, i):
    return stacked_matmul(x, w, i, **tiling)


def _loop_over_layers(gemm, L, count, x, w):
    """count products gemm(x, w, j mod L) in a fori_loop over j (the layer index traced)."""
    def body(j, acc):
        return acc + gemm(x, w, j % L)[:, :1].astype(jnp.float32)
    return jax.lax.fori_loop(0, count, body, jnp.zeros((x.shape[0], 1), jnp.float32))


def run(model, M, reps, repeats, tilings):
    L, gemms = SHAPES[model]
    rows = []
    for name, (K, N) in gemms.items():
        kx, kw = jax.random.split(jax.random.PRNGKey(K * 7 + N))
        w = (jax.random.normal(kw, (L, K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
        x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
        w_layers = [w[i] for i in range(L)]
        gemm_bytes = K * N * 2
        count = reps * L

        def looped(gemm, L=L, count=count):
            return functools.partial(_loop_over_layers, gemm, L, count)

        kwargs_of = {}
        forms = [("xla_layers", jax.jit(functools.partial(_each_layer_buffer, reps)), (x, w_layers)),
                 ("xla_stacked", jax.jit(looped(lambda x, w, i: jnp.matmul(x, w[i]))), (x, w))]
        for bn, bk, s, warps, stages, *flags in tilings:
            bn0, bk0, s0 = default_tiling(M, K, N)
            bn, bk, s = bn or bn0, bk or bk0, s or s0
            mode = flags[0] if flags else 0
            unroll = flags[1] if len(flags) > 1 else 1
            tile_acc, dot = mode == 1 and M == 1, mode == 2 and M == 1
            if N % bn or K % (bk * s) or (K // (bk * s)) % unroll:
                continue
            tag = (f"pallas[n{bn},k{bk},s{s},w{warps},st{stages}{',tile' if tile_acc else ''}"
                   f"{',dot' if dot else ''}{f',u{unroll}' if unroll > 1 else ''}]")
            kwargs = dict(block_n=bn, block_k=bk, splits=s, num_warps=warps, num_stages=stages,
                          tile_acc=tile_acc, dot=dot, unroll=unroll)
            gemm = functools.partial(_kernel_gemm, kwargs)
            forms.append((tag, jax.jit(looped(gemm)), (x, w)))
            kwargs_of[tag] = kwargs
            if not any(r.get("tiling") == tag and r["gemm"] == name for r in rows):  # each tiling checked
                out = np.asarray(jax.jit(gemm)(x, w, jnp.int32(L - 1)), np.float64)
                ref = np.asarray(x, np.float64) @ np.asarray(w[L - 1], np.float64)
                rows.append({"model": model, "gemm": name, "M": M, "form": "pallas_check", "tiling": tag,
                             "max_rel_err": float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))),
                             "finite": bool(np.all(np.isfinite(out)))})
        for tag, fn, args in forms:
            try:
                t = timed(fn, args, repeats)
            except Exception as e:  # a tiling this backend rejects
                rows.append({"model": model, "gemm": name, "M": M, "form": tag, "error": str(e)[:300]})
                continue
            us = t / count * 1e6
            rows.append({"model": model, "gemm": name, "M": M, "K": K, "N": N, "form": tag,
                         "us_per_gemm": round(us, 2), "weight_bytes": gemm_bytes,
                         "GBps": round(gemm_bytes / (us * 1e-6) / 1e9, 1),
                         **({"kwargs": kwargs_of[tag]} if tag in kwargs_of else {})})
        for r in rows:
            if r["gemm"] == name:
                print(json.dumps(r), flush=True)
        del w, w_layers
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/probe_stacked_matmul.json")
    ap.add_argument("--models", default="llama3.1-8b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=4, help="passes over the layers per timed call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tilings", default="0:0:0:4:3,0:0:0:4:4,0:64:0:4:3,64:0:0:4:3,0:0:0:8:3,128:64:0:2:4",
                    help="block_n:block_k:splits:warps:stages[:mode[:unroll]], comma-separated (0: default_tiling's; "
                         "mode at M = 1: 0 vector, 1 tile accumulation, 2 the MMA path on a padded row)")
    args = ap.parse_args()
    tilings = [tuple(int(v) for v in t.split(":")) for t in args.tilings.split(",") if t]
    rows = []
    for model in args.models.split(","):
        for M in (int(b) for b in args.batches.split(",")):
            rows += run(model, M, args.reps, args.repeats, tilings)
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "reps": args.reps,
           "repeats": args.repeats, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
