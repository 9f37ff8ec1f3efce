"""Decode-step benchmark: random bf16 weights, a KV cache of `context` random tokens, timed inside one jit.

For each (model, batch, context, cache, attention impl): fill a dense cache of `context` tokens with random
keys/values (converted in one bulk pass into a naive or certified tiered cache for those modes), then run
`--steps` greedy decode steps in a `lax.fori_loop` inside one jitted call (so Python dispatch is amortised),
and report time per step, tokens/s, peak device memory, tier-2 host bytes, the compile time and (certified)
the rung histogram of every head-step, against the memory floor

    floor = (weight bytes read per step + KV bytes read per step) / measured HBM bandwidth

where the bandwidth is measured in the same run (a fused read+write pass over a large array).

    python scripts/bench_decode.py --out results/bench_decode.json            # GPU, full grid (dense)
    python scripts/bench_decode.py --models llama3.1-8b --contexts 32768,131072 --batches 1,8,16 \
        --caches dense,naive,certified --impls einsum --out results/bench_decode.json   # issue 8's cache rows
    python scripts/bench_decode.py --models llama3.1-8b --contexts 32768 --batches 1 --caches certified \
        --impls einsum --soak-steps 10000 --out results/bench_decode_soak.json          # device memory flat?
    python scripts/bench_decode.py --models llama3.1-8b --contexts 32768 --batches 1 --caches dense,certified \
        --impls einsum --kv prefill --out results/bench_decode_prefill.json   # model-made K/V: the fast pass
    python scripts/bench_decode.py --smoke                                      # tiny CPU check

`--kv gaussian` (default) fills the cache with N(0, 1) keys and values: quick to build, but attention over them is
diffuse, so a certified cache escalates many head-steps (its rows time the ladder); `--kv prefill` runs the
model's own chunked prefill of random tokens (the product's path), whose caches stay at rung 0 like
`scripts/bench_generate.py`'s.

A batch that does not fit is recorded in "errors" (so the largest batch that fits each cache is visible).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from certattn_jax.dense_cache import DenseKVCache  # noqa: E402
from certattn_jax.memory import memory_report  # noqa: E402
from certattn_jax.model_cache import cache_spec  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402
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


PREFILL_CHUNK = 1024  # as scripts/bench_generate.py (--prefill-chunk: at 128K a chunk's float32 scores are 17 GB)


def make_step_loop(config: LlamaConfig, steps: int):
    """One jitted call of `steps` greedy decode steps (cache donated). Also returns the rung histogram [5] of
    every head-step of a certified cache (zeros for the others)."""
    def run(params, cache, tokens):
        def body(_, carry):
            cache, tok, hist = carry
            hidden, cache = llama.forward_hidden(params, config, tok[:, None], cache)
            logits = llama.logits_from_hidden(params, config, hidden[:, 0])
            if getattr(cache, "mode", "") == "certified":
                hist = hist + jnp.bincount(cache.step_record().rung.reshape(-1), length=5)
            return cache, jnp.argmax(logits, -1).astype(jnp.int32), hist

        return jax.lax.fori_loop(0, steps, body, (cache, tokens, jnp.zeros(5, jnp.int32)))

    return jax.jit(run, donate_argnums=(1,))


KV_KINDS = ("gaussian", "prefill")


def build_cache(config, batch, context, mode, impl, room, policy, kv="gaussian", params=None,
                prefill_chunk=PREFILL_CHUNK, staging_batch=None, seed_offset=0):
    """A cache of capacity `context` holding `context` - room tokens (room for the timed steps).

    kv "gaussian": keys and values drawn N(0, 1) for every layer (fast to build; attention over them is diffuse,
    so a certified cache sends many head-steps up the ladder: its rows then time the fallbacks, not the fast
    pass). kv "prefill": the model's own chunked prefill of random token ids into the dense staging cache,
    converted once (`models.generate.prefill`, the product's path): the keys, values and queries the model
    makes, so the certified rows time what a user's decode costs. staging_batch n < batch (tiered modes): the
    tiered cache built empty, then n sequences' dense K/V at a time converted into their rows
    (`TieredModelCache.with_staged_sequences`): the device never holds more than n sequences' dense K/V."""
    if kv not in KV_KINDS:
        raise ValueError(f"kv must be one of {KV_KINDS}, got {kv!r}")
    if mode == "dense":
        return _dense_kv(config, batch, context, room, kv, params, prefill_chunk, seed_offset, impl, None)
    spec = cache_spec(mode, config, jnp.bfloat16, policy)
    if staging_batch is None or staging_batch >= batch:
        return spec.from_staging(_dense_kv(config, batch, context, room, kv, params, prefill_chunk, seed_offset,
                                           impl, spec))
    full = spec(batch, context)
    for start in range(0, batch, staging_batch):
        n = min(staging_batch, batch - start)
        part = _dense_kv(config, n, context, room, kv, params, prefill_chunk, seed_offset + start, impl, spec)
        full = full.with_staged_sequences(start, part)
        del part
    return full


def _dense_kv(config, batch, context, room, kv, params, prefill_chunk, seed_offset, impl, spec):
    """A dense cache of `batch` sequences holding context - room tokens (`build_cache`'s kinds); the prefill
    with a tiered `spec` goes through its staging cache (which starts the kernels' self-checks meanwhile)."""
    if kv == "prefill":
        from models.generate import prefill

        rng = np.random.default_rng(batch * 7 + context + 1000 * seed_offset)
        prompts = [rng.integers(0, config.vocab_size, context - room).tolist() for _ in range(batch)]
        make = "dense" if spec is None else (lambda b, c: spec.staging(b, c))  # (a callable: not converted)
        cache, _ = prefill(params, config, prompts, context, cache_factory=make, prefill_chunk=prefill_chunk)
        return cache.replace(attn_impl=impl)
    key = jax.random.key(batch * 7 + context + 1000 * seed_offset)
    shape = (batch, config.num_kv_heads, context, config.head_dim)
    ks = jax.random.split(key, 2 * config.num_layers)
    return DenseKVCache(
        k=tuple(jax.random.normal(ks[2 * i], shape, jnp.bfloat16) for i in range(config.num_layers)),
        v=tuple(jax.random.normal(ks[2 * i + 1], shape, jnp.bfloat16) for i in range(config.num_layers)),
        lengths=jnp.full((batch,), context - room, jnp.int32), attn_impl=impl)


class DoesNotFit(RuntimeError):
    """A row whose cache alone needs more device memory than is free (not attempted)."""


def cache_build_bytes(config, batch, context, mode, policy, staging_batch=None) -> int:
    """The device bytes a row's cache needs at its build's peak, from shapes alone (`CacheSpec.bytes_per_sequence`):
    dense, its K/V; tiered, the batch's tier 1 plus one staging group's dense K/V. A lower bound: XLA's
    temporaries and the weights (already resident) are not counted."""
    per = cache_spec(mode, config, jnp.bfloat16, policy).bytes_per_sequence(context)
    if mode == "dense":
        return batch * per["staging"]
    group = batch if staging_batch is None else min(staging_batch, batch)
    return batch * per["device"] + group * per["staging"]


def check_fits(config, batch, context, mode, policy, staging_batch, dev) -> None:
    """DoesNotFit where the cache alone exceeds the device's free memory (the allocator's limit less what is in
    use): such a build is not attempted, since a failing allocation on the GPU retries for minutes (thirty-fifth
    session). Devices without memory statistics (the CPU) are not checked."""
    stats = dev.memory_stats() or {}
    if "bytes_limit" not in stats:
        return
    need = cache_build_bytes(config, batch, context, mode, policy, staging_batch)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if need > free:
        raise DoesNotFit(f"does not fit: the {mode} cache needs at least {need / 1e9:.2f} GB on the device, "
                         f"{free / 1e9:.2f} GB free of the allocator's {stats['bytes_limit'] / 1e9:.2f} GB limit "
                         "(not attempted)")


def bench_one(name, config, params, batch, context, impl, steps, reps, bw, mode="dense", policy=None,
              soak_steps=0, kv="gaussian", prefill_chunk=PREFILL_CHUNK, staging_batch=None):
    room = (reps + 2) * steps + 1 + soak_steps + steps
    if room >= context:
        raise ValueError(f"context {context} leaves no room for {room} decode steps")
    dev = jax.devices()[0]
    check_fits(config, batch, context, mode, policy, staging_batch, dev)
    t0 = time.perf_counter()
    cache = build_cache(config, batch, context, mode, impl, room, policy, kv, params, prefill_chunk, staging_batch)
    jax.block_until_ready(cache)
    build_s = time.perf_counter() - t0
    mem = memory_report(cache)
    # every input committed to the device, as the loop's outputs are: a committed/uncommitted mix between the
    # first call and the later ones would compile the loop twice (jit keys on it)
    tokens = jax.device_put(jnp.ones((batch,), jnp.int32), dev)
    if mode == "dense":
        cache = jax.device_put(cache, dev)
    loop = make_step_loop(config, steps)
    t0 = time.perf_counter()
    cache, tokens, hist = loop(params, cache, tokens)
    jax.block_until_ready(tokens)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cache, tokens, h = loop(params, cache, tokens)
        jax.block_until_ready(tokens)
        times.append((time.perf_counter() - t0) / steps)
        hist = hist + h
    soak = None
    if soak_steps:  # the cache was built with room for them; memory in use recorded after every call
        in_use, done = [], 0
        while done < soak_steps:
            cache, tokens, h = loop(params, cache, tokens)
            jax.block_until_ready(tokens)
            hist = hist + h
            done += steps
            in_use.append((dev.memory_stats() or {}).get("bytes_in_use"))
        soak = dict(steps=done, bytes_in_use_first=in_use[0], bytes_in_use_last=in_use[-1],
                    bytes_in_use_max=max(x or 0 for x in in_use), compiled_programs=loop._cache_size())
    step_s = statistics.median(times)
    # steps the whole ladder answered (the second pass) out of every step this cache ran, first call included
    slow = None
    if mode == "certified":
        ran = (reps + 1) * steps + (soak["steps"] if soak else 0)
        slow = dict(slow_steps=int(cache.slow_steps), steps=ran, schedule=cache.schedule,
                    looped_weights=llama.looped_weights(params))
    wb = weight_bytes(params)
    kvb = 2 * config.num_layers * batch * config.num_kv_heads * context * config.head_dim * 2
    read_b = wb + (kvb if mode == "dense" else mem["tier1_device_bytes"])
    floor_s = read_b / bw
    stats = dev.memory_stats() or {}
    row = dict(model=name, cache=mode, kv=kv, prefill_chunk=prefill_chunk if kv == "prefill" else None,
               batch=batch, context=context, attn_impl=impl, steps_per_call=steps,
               staging_batch=staging_batch if mode != "dense" else None,
               cache_build_s=build_s,
               step_ms=step_s * 1e3, step_ms_all=[t * 1e3 for t in times], tokens_per_s=batch / step_s,
               weight_bytes=wb, kv_bytes=kvb, tier1_device_bytes=mem["tier1_device_bytes"],
               tier2_host_bytes=mem["tier2_host_bytes"], floor_ms=floor_s * 1e3, ratio_to_floor=step_s / floor_s,
               compile_plus_first_call_s=compile_s, peak_device_bytes=stats.get("peak_bytes_in_use"),
               rung_histogram=[int(x) for x in hist] if mode == "certified" else None,
               tier1=policy.tier1 if policy else None, soak=soak, second_pass=slow)
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
    ap.add_argument("--caches", default="dense", help="comma list of dense, naive, certified")
    ap.add_argument("--tier1", choices=("jnp", "pallas"), default="pallas", help="the certified tier-1 pass")
    ap.add_argument("--kv", default="gaussian", help="comma list of what fills the cache: gaussian (random K/V)"
                    " and/or prefill (the model's own prefill of random tokens: the fast pass, not the ladder)")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="tokens per prefill call (--kv prefill)")
    ap.add_argument("--staging-batch", type=int, default=None,
                    help="build naive/certified caches this many sequences at a time (a batch dense cannot hold)")
    ap.add_argument("--soak-steps", type=int, default=0, help="then this many more steps, memory recorded")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny sizes (CPU check of the script)")
    args = ap.parse_args()
    if args.staging_batch is not None and args.staging_batch < 1:
        ap.error(f"--staging-batch must be >= 1, got {args.staging_batch}")
    policy = CertPolicy(tier1=args.tier1)
    if args.smoke:
        args.models, args.batches, args.contexts, args.steps, args.reps = "tiny", "1,2", "256", 4, 2
        policy = CertPolicy(tier1="jnp", block_size=16, group_size=16)
    dev = jax.devices()[0]
    bws = measure_bandwidth(64 << 20 if args.smoke else 4 << 30)
    bw = bws["used"]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, measured bandwidth: "
          f"read-only {bws['read_only'] / 1e12:.2f} TB/s, read+write {bws['read_write'] / 1e12:.2f} TB/s",
          flush=True)
    rows, errors = [], []
    for name in args.models.split(","):
        config = MODELS[name]
        params = llama.init_params(config, jax.random.key(0), jnp.bfloat16)
        if not args.unfused:
            params = llama.fuse_projections(params)
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                for mode, kv in ((m, k) for k in args.kv.split(",") for m in args.caches.split(",")):
                    for impl in args.impls.split(",") if mode == "dense" else ["einsum"]:
                        try:
                            row = bench_one(name, config, params, batch, context, impl, args.steps, args.reps, bw,
                                            mode, policy, args.soak_steps, kv, args.prefill_chunk,
                                            args.staging_batch)
                        except Exception as e:  # noqa: BLE001 - e.g. a batch that does not fit: recorded
                            errors.append(dict(model=name, cache=mode, kv=kv, batch=batch, context=context,
                                               attn_impl=impl, error=f"{type(e).__name__}: {e}"[:600]))
                            print(f"{name} B={batch} ctx={context} {mode}: FAILED {type(e).__name__}: {e}"[:300],
                                  flush=True)
                            _write(args.out, dev, bws, rows, errors)
                            continue
                        row["fused_projections"] = not args.unfused
                        rows.append(row)
                        print(f"{name:12s} B={batch:<2d} ctx={context:<6d} {mode:9s} {kv:8s} {impl:7s} step "
                              f"{row['step_ms']:8.3f} ms floor {row['floor_ms']:7.3f} ms  "
                              f"x{row['ratio_to_floor']:.2f}  {row['tokens_per_s']:9.1f} tok/s  "
                              f"rungs {row['rung_histogram']}", flush=True)
                        _write(args.out, dev, bws, rows, errors)
        del params
    if args.out:
        print(f"wrote {args.out}")


def _write(out, dev, bws, rows, errors=()) -> None:
    if not out:
        return
    result = dict(device=dev.device_kind, platform=dev.platform, jax_version=jax.__version__,
                  python=platform.python_version(), measured_bandwidth_Bps=bws,
                  device_bytes_limit=(dev.memory_stats() or {}).get("bytes_limit"),
                  xla_python_client_mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                  timing="median over reps of (one jitted fori_loop of steps_per_call decode steps) / steps",
                  rows=rows, errors=list(errors))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
