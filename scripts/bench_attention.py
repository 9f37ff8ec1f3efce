"""One decode step of attention over one LLaMA-3.1-8B layer, device-timed: dense baselines vs naive vs certified.

Shapes: 32 query heads, 8 KV heads, d = 128, bf16; contexts 8K-128K, batch 1 and 8 (issue 8's grid). Rows of
`results/bench_attention.json`: {"impl", "data", "context", "batch", "median_us", "bytes", "rungs", ...} with

  torch_sdpa_bf16     torch's scaled_dot_product_attention, replayed from a CUDA graph (CUDA events)
  jax_cudnn_bf16      jax.nn.dot_product_attention(implementation="cudnn")
  jax_xla_bf16        einsum softmax einsum, float32 accumulation
  pallas_dense_bf16   jax's Pallas decode kernel (`decode_attention.gqa`, k_splits 128)
  naive               INT8/INT4 attention without certification: the tier-1 kernel + its combine (`--tier1
                      pallas`) or XLA (`jnp`)
  certified           the model's per-layer certified step (`ladder.run_fast`: rungs 0-1; a head needing more
                      is counted in "escalations", answered by the whole ladder in the model)
  certified_full      the whole ladder (`ladder.run`) with no forced fallback
  certified_rung1..4  the whole ladder with every head forced up to that rung (`ladder.run(min_rung=...)`;
                      rung 3 with rung 4 disabled). Rungs 3-4 move tier-2 bytes over PCIe ("pcie_bytes").

Data: "gaussian" (random keys/values) and "peaked" (an attention sink on the first tokens, a recent window and
three needle blocks aligned with the query, like real LLM attention); baselines on gaussian only (their cost
does not depend on the data). The certified loops carry the hot set from step to step (as the model does).

Timing: each variant runs n1 and n2 times inside one jit (a step-dependent query), per call = (t(n2) - t(n1))
/ (n2 - n1): dispatch and fixed costs cancel. Median of --reps. "bytes" is what a variant must read at least
(dense: K and V; ours: tier 1), "floor_us" that over the bandwidth measured in the same run.

    python scripts/bench_attention.py --out results/bench_attention.json          # the whole grid, GPU
    python scripts/bench_attention.py --smoke                                     # tiny, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _device_timing as timing  # noqa: E402
from _device_timing import (  # noqa: E402
    cudnn_attention,
    hot_set,
    measure_bandwidth,
    per_call_us,
    q_at,
    torch_sdpa_us,
    xla_attention,
)

from certattn_jax import ladder, select  # noqa: E402
from certattn_jax.attention import naive_attention  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.memory import memory_report  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
from certattn_jax.step import uses_fused_rung0  # noqa: E402

RESULT: dict = {"rows": [], "errors": []}


def log(*a) -> None:
    print(*a, flush=True)


def save(path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(RESULT, indent=1) + "\n")





def stateless_loop(step, q0, args):
    """n calls of step(q, *args); the whole output is carried (a reduced output lets XLA hoist reads)."""
    def make(n):
        @jax.jit
        def run(q0, args):
            shape = jax.eval_shape(step, q0, *args).shape

            def body(i, acc):
                out = step(q_at(q0, i), *args)
                return acc + jnp.where(jnp.isfinite(out), out, 0.0).astype(jnp.float32)
            return jax.lax.fori_loop(0, n, body, jnp.zeros(shape, jnp.float32))
        return lambda: run(q0, args)
    return make


def certified_loop(q0, cache, policy, fast: bool, min_rung: int = 0):
    """n certified steps carrying the hot set (the rest of the cache is read-only: carrying it all would make XLA
    copy it, tier 2 included, on every call). Returns (out sum, rung histogram [5], escalations)."""
    def make(n):
        @jax.jit
        def run(q0, cache):
            def body(i, carry):
                acc, hot, hist, esc = carry
                c = cache.replace(**hot)
                if fast:
                    out, cert, c, e = ladder.run_fast(q_at(q0, i), c, policy)
                    esc = esc + jnp.sum(e)
                else:
                    out, cert, c = ladder.run(q_at(q0, i), c, policy, min_rung=min_rung)
                hist = hist + jnp.bincount(cert.rung.reshape(-1), length=5)
                return acc + out.astype(jnp.float32), hot_set(c), hist, esc
            init = (jnp.zeros(q0.shape, jnp.float32), hot_set(cache),
                    jnp.zeros(5, jnp.int32), jnp.zeros((), jnp.int32))
            return jax.lax.fori_loop(0, n, body, init)
        return lambda: run(q0, cache)
    return make




def make_data(kind: str, B: int, T: int, H: int, G: int, d: int, seed: int):
    """q [B, H*G, d], k, v [B, T, H, d] bf16. peaked: keys of an attention sink (first 4 tokens), a recent window
    (last 64) and three needle blocks lean towards the mean query of their KV head."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, H * G, d), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, H, d), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, H, d), jnp.float32)
    if kind == "peaked":
        qdir = q.reshape(B, H, G, d).mean(axis=2)
        qdir = qdir / jnp.linalg.norm(qdir, axis=-1, keepdims=True)  # [B, H, d]
        t = jnp.arange(T)
        lift = jnp.zeros((T,))
        lift = jnp.where(t < 4, 10.0, lift)
        lift = jnp.where(t >= T - 64, 4.0, lift)
        for c in jax.random.choice(ks[3], T // 64 - 2, (3,), replace=False):
            lift = jnp.where((t >= 64 * (c + 1)) & (t < 64 * (c + 1) + 8), 8.0, lift)
        k = k + lift[None, :, None, None] * qdir[:, None, :, :]
    return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)






def pallas_dense(q, k, v):
    from jax.experimental.pallas.ops.gpu import decode_attention

    return decode_attention.gqa(q, k, v, k_splits=128)




def bench(T: int, B: int, args, bw: float) -> None:
    H, G, d = args.kv_heads, args.groups, args.head_dim
    n1, n2, reps = args.n1, args.n2, args.reps
    dense_bytes = 2 * B * H * T * d * 2
    impls = set(args.impls)

    def add(impl, data, us, nbytes, **extra):
        row = dict(impl=impl, data=data, context=T, batch=B, median_us=round(us, 2), bytes=int(nbytes),
                   floor_us=round(nbytes / bw * 1e6, 2), **extra)
        RESULT["rows"].append(row)
        log(json.dumps(row))
        save(args.out)

    def attempt(name, fn):
        if name in impls and not timing.attempt(RESULT, name, T, B, fn):
            save(args.out)

    q, k, v = make_data("gaussian", B, T, H, G, d, seed=T + B)
    gpu = jax.default_backend() == "gpu"
    for name, fn in (("jax_xla_bf16", xla_attention), ("jax_cudnn_bf16", cudnn_attention),
                     ("pallas_dense_bf16", pallas_dense)):
        if name != "jax_xla_bf16" and not gpu:
            continue
        attempt(name, lambda name=name, fn=fn: add(name, "gaussian", per_call_us(
            stateless_loop(fn, q, (k, v)), n1, n2, reps)[0], dense_bytes))
    if gpu:
        attempt("torch_sdpa_bf16", lambda: add("torch_sdpa_bf16", "gaussian", torch_sdpa_us(B, T, H, H * G, d, n2),
                                               dense_bytes))
    for data in ("gaussian", "peaked"):
        if data == "peaked":
            q, k, v = make_data("peaked", B, T, H, G, d, seed=T + B)
        bench_certified(data, q, k, v, args, add, attempt, dense_bytes)


def bench_certified(data: str, q, k, v, args, add, attempt, dense_bytes: int) -> None:
    """naive (gaussian only), certified and certified_full on this data; the forced rungs on gaussian."""
    B, Hq, d = q.shape
    n1, n2, reps = args.n1, args.n2, args.reps
    policy = args.policy
    cache = jax.jit(lambda k, v: TieredKVCache.from_dense(k, v, policy))(k, v)
    t1_bytes = memory_report(cache)["tier1_device_bytes"]
    if data == "gaussian":
        def naive(q, c):  # the product's naive attention: the tier-1 kernel (+ residual) when tier1 is pallas
            return naive_attention(q, c, policy)
        attempt("naive", lambda: add("naive", data, per_call_us(stateless_loop(naive, q, (cache,)), n1, n2,
                                                                 reps)[0], t1_bytes, tier1=policy.tier1))

    def certified(name, fast, min_rung=0, pol=policy, m1=n1, m2=n2, pcie=0):
        us, (_, _, hist, esc) = per_call_us(certified_loop(q, cache, pol, fast, min_rung), m1, m2, reps)
        add(name, data, us, t1_bytes, rungs=[int(x) for x in hist], escalations=int(esc), tier1=pol.tier1,
            rung0=pol.rung0, rung0_ran="fused" if uses_fused_rung0(cache, pol) else "jnp", pcie_bytes=pcie)

    attempt("certified", lambda: certified("certified", True))
    attempt("certified_full", lambda: certified("certified_full", False))
    if data == "gaussian":
        few1, few2 = max(1, n1 // 8), max(2, n2 // 8)  # rungs 3-4 move K and V over PCIe every step
        no_rung4 = dataclasses.replace(policy, layer_fallback_fraction=2.0)
        attempt("certified_rung1", lambda: certified("certified_rung1", False, 1))
        attempt("certified_rung2", lambda: certified("certified_rung2", False, 2))
        attempt("certified_rung3", lambda: certified("certified_rung3", False, 3, no_rung4, few1, few2, dense_bytes))
        attempt("certified_rung4", lambda: certified("certified_rung4", False, 3, policy, few1, few2, dense_bytes))


IMPLS = ("torch_sdpa_bf16", "jax_cudnn_bf16", "jax_xla_bf16", "pallas_dense_bf16", "naive", "certified",
         "certified_full", "certified_rung1", "certified_rung2", "certified_rung3", "certified_rung4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--tier1", choices=("jnp", "pallas"), default="pallas")
    ap.add_argument("--rung0", choices=("auto", "jnp", "fused"), default="auto",
                    help="rung-0 implementation of the certified rows (auto: the product's default, per block count)")
    ap.add_argument("--n1", type=int, default=8)
    ap.add_argument("--n2", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): checks the script runs")
    args = ap.parse_args()
    args.kv_heads, args.groups, args.head_dim = 8, 4, 128
    args.policy = CertPolicy(tier1=args.tier1, rung0=args.rung0)
    if args.smoke:
        args.contexts, args.batches, args.n1, args.n2, args.reps = "512", "1", 1, 3, 1
        args.kv_heads, args.groups, args.head_dim = 2, 2, 64
        args.policy = CertPolicy(tier1=args.tier1, rung0=args.rung0, k_max=2, v_max=2)
    dev = jax.devices()[0]
    bw = measure_bandwidth(64 << 20 if args.smoke else 4 << 30)
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    RESULT.update(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, torch=torch_version,
                  measured_bandwidth_Bps=bw, policy=repr(args.policy), n1=args.n1, n2=args.n2, reps=args.reps,
                  shape=dict(kv_heads=args.kv_heads, query_heads=args.kv_heads * args.groups, head_dim=args.head_dim),
                  fetch=dict(unroll_up_to=select.FETCH_UNROLL_UP_TO,
                             whole_below_bytes=select.FETCH_WHOLE_LAYER_BELOW_BYTES))
    log(f"device {dev.device_kind}, jax {jax.__version__}, torch {torch_version}, read bw {bw / 1e12:.2f} TB/s")
    for T in [int(t) for t in args.contexts.split(",")]:
        for B in [int(b) for b in args.batches.split(",")]:
            bench(T, B, args, bw)
    save(args.out)
    rows = RESULT["rows"]
    if not rows:
        raise SystemExit("no row measured")
    by_key = {(r["impl"], r["data"], r["context"], r["batch"]): r["median_us"] for r in rows}
    for (impl, data, T, B), us in sorted(by_key.items(), key=lambda x: (x[0][2], x[0][3], x[0][0])):
        dense = [by_key.get((b, "gaussian", T, B)) for b in ("torch_sdpa_bf16", "jax_cudnn_bf16", "jax_xla_bf16",
                                                               "pallas_dense_bf16")]
        dense = [x for x in dense if x]
        ratio = f"{us / min(dense):6.2f}x fastest dense" if dense else ""
        log(f"T={T:6d} B={B} {impl:18s} {data:8s} {us:10.1f} us {ratio}")
    assert np.isfinite([r["median_us"] for r in rows]).all()


if __name__ == "__main__":
    main()
