"""Batch-1 bf16 matrix-vector products of LLaMA-3.1-8B layer shapes, timed inside one jit: how close does
XLA's GEMV get to the bandwidth floor, separately and with projections fused (q|k|v, gate|up)?

    python scripts/bench_gemv.py --out results/bench_gemv.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import measure_bandwidth  # noqa: E402

SHAPES = {"wq/wo": (4096, 4096), "wk/wv": (4096, 1024), "w_gate/w_up": (4096, 14336), "w_down": (14336, 4096),
          "fused qkv": (4096, 6144), "fused gate|up": (4096, 28672), "lm_head": (4096, 128256)}


def bench_one(name: str, n_in: int, n_out: int, layout: str, iters: int, bws: dict) -> dict:
    """Time y = x @ W (W [in, out], layout "in_out") or y = x @ W.T (W [out, in], "out_in"), x [1, in]."""
    shape = (n_in, n_out) if layout == "in_out" else (n_out, n_in)
    # four distinct weights per iteration so that consecutive products do not hit L2
    ws = [jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(4)]
    x0 = jax.random.normal(jax.random.key(9), (1, n_in), jnp.bfloat16)
    spec = "bi,io->bo" if layout == "in_out" else "bi,oi->bo"

    @jax.jit
    def loop(ws, x0):
        def body(i, x):
            for w in ws:
                y = jnp.einsum(spec, x, w)
                x = x + (jnp.sum(y.astype(jnp.float32)) * 1e-9).astype(jnp.bfloat16)
            return x
        return jax.lax.fori_loop(0, iters, body, x0)

    jax.block_until_ready(loop(ws, x0))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(ws, x0))
        best = min(best, time.perf_counter() - t0)
    per = best / (iters * 4)
    nbytes = n_in * n_out * 2
    print(f"{name:14s} {layout:6s} {n_in}x{n_out}: {per * 1e6:8.1f} us  {nbytes / per / 1e12:.2f} TB/s "
          f"(floor {nbytes / bws['used'] * 1e6:.1f} us)", flush=True)
    return dict(name=name, layout=layout, shape=[n_in, n_out], us=per * 1e6, achieved_Bps=nbytes / per,
                floor_us=nbytes / bws["used"] * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    scale = 16 if args.smoke else 1
    bws = measure_bandwidth(64 << 20 if args.smoke else 4 << 30)
    rows = []
    for name, (n_in, n_out) in SHAPES.items():
        for layout in ("in_out", "out_in"):
            rows.append(bench_one(name, n_in // scale, n_out // scale, layout, args.iters, bws))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                                                  measured_bandwidth_Bps=bws, rows=rows), indent=1))


if __name__ == "__main__":
    main()
