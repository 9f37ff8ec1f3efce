"""One decode step of attention over one layer, timed on the device: dense vs naive vs certified.

Shapes of a LLaMA-3.1-8B layer (32 query heads, 8 KV heads, d = 128), batch 1, contexts 8K and 32K, bf16.
Each variant runs `--steps` times inside one jitted fori_loop (dispatch amortised); the certified variant
carries its cache (the hot set) through the loop, as the model does. Also reports the cost of the
control flow the certified path adds (a lax.cond on a device predicate per layer and step), the bytes each
variant must read at least, and the measured HBM bandwidth of the same run.

    python scripts/bench_attention.py --out results/bench_attention.json
    python scripts/bench_attention.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import measure_bandwidth  # noqa: E402

from certattn_jax.attention import (  # noqa: E402
    certified_attention_fast,
    certified_attention_step,
    dense_attention_f32,
    naive_attention,
)
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.memory import memory_report  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402


def hot_of(cache: TieredKVCache) -> dict:
    return {f: getattr(cache, f) for f in ("hot_k", "hot_v", "hot_ids", "hot_used")}


def timed(fn, args, reps):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def bench_context(T: int, B: int, H: int, G: int, d: int, steps: int, reps: int, policy, bws) -> dict:
    keys = jax.random.split(jax.random.key(T), 3)
    k = jax.random.normal(keys[0], (B, T, H, d), jnp.bfloat16)
    v = jax.random.normal(keys[1], (B, T, H, d), jnp.bfloat16)
    q0 = jax.random.normal(keys[2], (B, H * G, d), jnp.bfloat16)
    t0 = time.perf_counter()
    cache = jax.jit(lambda k, v: TieredKVCache.from_dense(k, v, policy))(k, v)
    jax.block_until_ready(cache)
    build_s = time.perf_counter() - t0
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    lengths = jnp.full((B,), T, jnp.int32)

    def q_at(i):
        return (q0.astype(jnp.float32) * (1 + 1e-3 * i.astype(jnp.float32))).astype(jnp.bfloat16)

    @jax.jit
    def dense_loop(kh, vh):
        def body(i, acc):
            return acc + dense_attention_f32(q_at(i), kh, vh, lengths).astype(jnp.bfloat16).astype(jnp.float32)
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((B, H * G, d)))

    @jax.jit
    def naive_loop(cache):
        def body(i, acc):
            return acc + naive_attention(q_at(i), cache).astype(jnp.float32)
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((B, H * G, d)))

    # The loops carry only the hot set (what a step changes) and read the rest of the cache from the jit
    # argument: carrying the whole cache makes XLA copy it, tier 2 included, on entry to every call.
    @jax.jit
    def cert_loop(cache, policy):
        def body(i, carry):
            acc, hot, rung_hist = carry
            out, cert, c = certified_attention_step(q_at(i), cache.replace(**hot), policy)
            hist = rung_hist + jnp.bincount(cert.rung.reshape(-1), length=5)
            return acc + out.astype(jnp.float32), hot_of(c), hist
        return jax.lax.fori_loop(0, steps, body, (jnp.zeros((B, H * G, d)), hot_of(cache), jnp.zeros(5, jnp.int32)))

    @jax.jit
    def fast_loop(cache, policy):  # the model's fast pass: rungs 0-1 only (escalations counted, not answered)
        def body(i, carry):
            acc, hot, rung_hist, esc = carry
            out, cert, c, escalate = certified_attention_fast(q_at(i), cache.replace(**hot), policy)
            hist = rung_hist + jnp.bincount(cert.rung.reshape(-1), length=5)
            return acc + out.astype(jnp.float32), hot_of(c), hist, esc + jnp.sum(escalate)
        init = (jnp.zeros((B, H * G, d)), hot_of(cache), jnp.zeros(5, jnp.int32), jnp.zeros((), jnp.int32))
        return jax.lax.fori_loop(0, steps, body, init)

    @jax.jit
    def cond_loop(x):  # the control-flow cost: a never-taken lax.cond on a device predicate per iteration
        def body(i, y):
            return jax.lax.cond(jnp.sum(y) > 1e30, lambda z: z * 2.0, lambda z: z + 1.0, y)
        return jax.lax.fori_loop(0, steps * 32, body, x)

    @jax.jit
    def where_loop(x):
        def body(i, y):
            return jnp.where(jnp.sum(y) > 1e30, y * 2.0, y + 1.0)
        return jax.lax.fori_loop(0, steps * 32, body, x)

    small = jnp.ones((128,))
    t_dense, _ = timed(dense_loop, (kh, vh), reps)
    t_naive, _ = timed(naive_loop, (cache,), reps)
    t_cert, (acc, _, hist) = timed(cert_loop, (cache, policy), reps)
    t_fast, (_, _, fast_hist, fast_esc) = timed(fast_loop, (cache, policy), reps)
    t_cond, _ = timed(cond_loop, (small,), reps)
    t_where, _ = timed(where_loop, (small,), reps)
    mem = memory_report(cache)
    dense_bytes = 2 * B * H * T * d * 2
    tier1_read = mem["tier1_device_bytes"]
    per_iter = steps * 32
    row = dict(context=T, batch=B, kv_heads=H, q_heads=H * G, head_dim=d, steps_per_call=steps,
               dense_us=t_dense / steps * 1e6, naive_us=t_naive / steps * 1e6, certified_us=t_cert / steps * 1e6,
               certified_fast_us=t_fast / steps * 1e6, tier1=policy.tier1,
               certified_fast_rung_histogram=[int(x) for x in fast_hist], certified_fast_escalations=int(fast_esc),
               cond_overhead_us=(t_cond - t_where) / per_iter * 1e6, cond_loop_iter_us=t_cond / per_iter * 1e6,
               where_loop_iter_us=t_where / per_iter * 1e6,
               dense_floor_us=dense_bytes / bws["used"] * 1e6, tier1_floor_us=tier1_read / bws["used"] * 1e6,
               tier1_fraction=mem["tier1_fraction"], build_cache_s=build_s,
               certified_rung_histogram=[int(x) for x in hist])
    print(f"T={T:6d} dense {row['dense_us']:8.1f} us (floor {row['dense_floor_us']:.1f})  "
          f"naive {row['naive_us']:8.1f} us  certified {row['certified_us']:8.1f} us "
          f"fast {row['certified_fast_us']:8.1f} us "
          f"(tier-1 floor {row['tier1_floor_us']:.1f})  cond {row['cond_loop_iter_us']:.1f} vs where "
          f"{row['where_loop_iter_us']:.1f} us/iter  rungs {row['certified_rung_histogram']}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tier1", choices=("jnp", "pallas"), default=None, help="the policy's tier-1 implementation")
    args = ap.parse_args()
    B, H, G, d = 1, 8, 4, 128
    if args.smoke:
        args.contexts, args.steps, args.reps, H, G, d = "512", 3, 2, 2, 2, 64
    dev = jax.devices()[0]
    bws = measure_bandwidth(64 << 20 if args.smoke else 4 << 30)
    print(f"device {dev.device_kind}, jax {jax.__version__}, read bw {bws['read_only'] / 1e12:.2f} TB/s", flush=True)
    policy = CertPolicy() if args.tier1 is None else CertPolicy(tier1=args.tier1)
    contexts = [int(t) for t in args.contexts.split(",")]
    rows = [bench_context(T, B, H, G, d, args.steps, args.reps, policy, bws) for T in contexts]
    result = dict(device=dev.device_kind, platform=dev.platform, jax_version=jax.__version__,
                  measured_bandwidth_Bps=bws, policy=repr(policy), rows=rows,
                  note=f"tier-1 pass: {policy.tier1}; certified = full ladder, "
                  "certified_fast = the model's rungs-0-1 pass")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
