"""Decode-step benchmark: dense bf16 KV cache, random bf16 weights, timed inside one jit.

For each (model, batch, context, attention impl): fill a dense cache of `context` tokens with random
keys/values, then run `--steps` greedy decode steps in a `lax.fori_loop` inside one jitted call (so
Python dispatch is amortised), and report time per step against the memory floor

    floor = (weight bytes read per step + KV bytes read per step) / measured HBM bandwidth

where the bandwidth is measured in the same run (a fused read+write pass over a large array).

    python scripts/bench_decode.py --out results/bench_decode.json            # GPU, full grid
    python scripts/bench_decode.py --smoke                                      # tiny CPU check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from certattn_jax.dense_cache import DenseKVCache  # noqa: E402
from models import llama  # noqa: E402
from models.config import LlamaConfig, RopeScaling  # noqa: E402

MODELS = {
    # SmolLM2-135M-Instruct's exact shapes (speed does not depend on the weight values).
    "smollm2": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
                           max_position_embeddings=131072, tie_word_embeddings=True),
    "llama3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                               num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=5e5,
                               max_position_embeddings=131072,
                               rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)),
    "tiny": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=4096),
}


def measure_bandwidth(nbytes: int = 4 << 30, reps: int = 10) -> dict[str, float]:
    """HBM bandwidth in bytes/s, two ways: a read-only reduction over a large bf16 array (what decode
    mostly does), and a fused read+write pass (bytes read + bytes written). The floor uses the larger."""
    n = nbytes // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)

    @jax.jit
    def reads(x):  # the carried scale keeps XLA from hoisting the reduction out of the loop
        return jax.lax.fori_loop(0, reps, lambda i, c: jnp.sum(x * c, dtype=jnp.float32).astype(
            jnp.bfloat16) * jnp.bfloat16(1e-9) + c, jnp.bfloat16(1.0))

    @jax.jit
    def read_writes(x):
        return jax.lax.fori_loop(0, reps, lambda i, y: y * jnp.bfloat16(0.999) + jnp.bfloat16(0.001), x)

    def best(fn):
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        return min(times)

    read_bw = n * 2 * reps / best(reads)
    rw_bw = 2 * n * 2 * reps / best(read_writes)
    return {"read_only": read_bw, "read_write": rw_bw, "used": max(read_bw, rw_bw)}


def weight_bytes(params) -> int:
    """Bytes of every parameter read in one decode step (all but the embedding gather)."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
    total += params["final_norm"].size * params["final_norm"].dtype.itemsize
    head = params.get("lm_head", params["embed"])  # tied models read the embedding as the head
    return total + head.size * head.dtype.itemsize


def make_step_loop(config: LlamaConfig, steps: int):
    def run(params, cache, tokens):
        def body(_, carry):
            cache, tok = carry
            hidden, cache = llama.forward_hidden(params, config, tok[:, None], cache)
            logits = llama.logits_from_hidden(params, config, hidden[:, 0])
            return cache, jnp.argmax(logits, -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, tokens))

    return jax.jit(run, donate_argnums=(1,))


def bench_one(name, config, params, batch, context, impl, steps, reps, bw):
    key = jax.random.key(batch * 7 + context)
    shape = (batch, config.num_kv_heads, context, config.head_dim)
    ks = jax.random.split(key, 2 * config.num_layers)
    cache = DenseKVCache(
        k=tuple(jax.random.normal(ks[2 * i], shape, jnp.bfloat16) for i in range(config.num_layers)),
        v=tuple(jax.random.normal(ks[2 * i + 1], shape, jnp.bfloat16) for i in range(config.num_layers)),
        lengths=jnp.full((batch,), context - (reps + 2) * steps - 1, jnp.int32), attn_impl=impl)
    tokens = jnp.ones((batch,), jnp.int32)
    loop = make_step_loop(config, steps)
    t0 = time.perf_counter()
    cache, tokens = loop(params, cache, tokens)
    jax.block_until_ready(tokens)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cache, tokens = loop(params, cache, tokens)
        jax.block_until_ready(tokens)
        times.append((time.perf_counter() - t0) / steps)
    step_s = statistics.median(times)
    wb = weight_bytes(params)
    kvb = 2 * config.num_layers * batch * config.num_kv_heads * context * config.head_dim * 2
    floor_s = (wb + kvb) / bw
    row = dict(model=name, batch=batch, context=context, attn_impl=impl, steps_per_call=steps,
               step_ms=step_s * 1e3, step_ms_all=[t * 1e3 for t in times], tokens_per_s=batch / step_s,
               weight_bytes=wb, kv_bytes=kvb, floor_ms=floor_s * 1e3, ratio_to_floor=step_s / floor_s,
               compile_plus_first_call_s=compile_s)
    del cache
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,llama3.1-8b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--impls", default="einsum,reduce")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--unfused", action="store_true", help="keep q/k/v and gate/up as separate matrices")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny sizes (CPU check of the script)")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.batches, args.contexts, args.steps, args.reps = "tiny", "1,2", "256", 4, 2
    dev = jax.devices()[0]
    bws = measure_bandwidth(64 << 20 if args.smoke else 4 << 30)
    bw = bws["used"]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, measured bandwidth: "
          f"read-only {bws['read_only'] / 1e12:.2f} TB/s, read+write {bws['read_write'] / 1e12:.2f} TB/s",
          flush=True)
    rows = []
    for name in args.models.split(","):
        config = MODELS[name]
        params = llama.init_params(config, jax.random.key(0), jnp.bfloat16)
        if not args.unfused:
            params = llama.fuse_projections(params)
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                for impl in args.impls.split(","):
                    row = bench_one(name, config, params, batch, context, impl, args.steps, args.reps, bw)
                    row["fused_projections"] = not args.unfused
                    rows.append(row)
                    print(f"{name:12s} B={batch:<2d} ctx={context:<6d} {impl:7s} step {row['step_ms']:8.3f} ms "
                          f"floor {row['floor_ms']:7.3f} ms  x{row['ratio_to_floor']:.2f}  "
                          f"{row['tokens_per_s']:9.1f} tok/s", flush=True)
                    _write(args.out, dev, bws, rows)
        del params
    if args.out:
        print(f"wrote {args.out}")


def _write(out, dev, bws, rows) -> None:
    if not out:
        return
    result = dict(device=dev.device_kind, platform=dev.platform, jax_version=jax.__version__,
                  python=platform.python_version(), measured_bandwidth_Bps=bws,
                  timing="median over reps of (one jitted fori_loop of steps_per_call decode steps) / steps",
                  rows=rows)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
