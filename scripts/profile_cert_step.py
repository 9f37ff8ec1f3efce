"""Where one certified attention step's time goes: its phases timed as growing prefixes, on the device.

Each phase runs `--steps` times inside one jitted fori_loop (a step-dependent query; every output leaf is
reduced into the carry so nothing is dead code), median of `--reps` calls. Phases, each including the ones
before it: tier1 (the INT partials only), context (build_context), select (+ select_and_promote),
rung0 (+ evaluate_stage of rung 0), fast (ladder.run_fast: rungs 0-1, the model's fast pass), full
(ladder.run). Baselines in the same run: dense (exact attention over bf16 K/V) and naive (INT8/INT4, no
certification). Also counts the kernel launches per loop iteration of each phase in the compiled HLO.

    python scripts/profile_cert_step.py --shapes 8b:32768 smol:1024 --tier1 jnp pallas --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _device_timing import LAYER_SHAPES, hot_set, q_at, random_layer  # noqa: E402
from bench_generate import count_launches  # noqa: E402

from certattn_jax import ladder, step  # noqa: E402
from certattn_jax.attention import naive_attention  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402


def _reduce(tree) -> jax.Array:
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.number)
              or x.dtype == jnp.bool_]
    return sum(jnp.sum(jnp.where(jnp.isfinite(x.astype(jnp.float32)), x.astype(jnp.float32), 0.0)) for x in leaves)


def phases(policy: CertPolicy):
    def tier1(q, c):
        q_s = step.scaled_query(q.astype(jnp.float32).reshape(c.batch, c.num_kv_heads, -1, c.head_dim))
        valid = jnp.arange(c.num_blocks)[None, :] < (c.flushed // c.block_size)[:, None]
        return step.tier1_partials(q_s, c, valid, policy.tier1), c

    def context(q, c):
        return step.build_context(q, c, policy), c

    def select(q, c):
        ctx = step.build_context(q, c, policy)
        return (ctx, ladder.select_and_promote(ctx, c, policy)), c

    def rung0(q, c):
        if policy.rung0 == "fused":
            return step.rung0_fused(q, c, policy).stage, c
        ctx = step.build_context(q, c, policy)
        sel = ladder.select_and_promote(ctx, c, policy)
        return step.evaluate_stage(ctx, [sel.hot], q.dtype, policy), c

    def fast(q, c):
        out, cert, c, esc = ladder.run_fast(q, c, policy)
        return (out, cert, esc), c

    def full(q, c):
        out, cert, c = ladder.run(q, c, policy)
        return (out, cert), c

    def naive(q, c):
        return naive_attention(q, c), c

    return dict(naive=naive, tier1=tier1, context=context, select=select, rung0=rung0, fast=fast, full=full)


def set_rung0_variant(variant: str | None) -> dict | None:
    """Apply "CHUNKxWARPS" to the fused rung 0 (`pallas_kernels.certify_rung0`'s pass width and warps, read when
    a step is traced) and forget the self-check verdicts, so the variant is checked before it is used. Returns
    the settings in force (None for variant None: the module's own)."""
    from pallas_kernels import certify_rung0, selftest

    if variant:
        chunk, warps = (int(x) for x in variant.lower().split("x"))
        if chunk not in certify_rung0.CHUNK_CHOICES or warps not in certify_rung0.WARP_CHOICES:
            raise SystemExit(f"--rung0-variants {variant}: chunk in {certify_rung0.CHUNK_CHOICES}, warps in "
                             f"{certify_rung0.WARP_CHOICES}")
        certify_rung0.DEFAULT_CHUNK, certify_rung0.DEFAULT_WARPS = chunk, warps
        selftest.rung0_trusted.cache_clear()
    return dict(chunk=certify_rung0.DEFAULT_CHUNK, warps=certify_rung0.DEFAULT_WARPS)


def trace_loop(compiled, cache, steps: int, trace_dir: str) -> dict:
    """One more call of a compiled timing loop under `jax.profiler.trace`: its device kernels per step, by name
    and HLO scope, busy against idle (`trace_decode.summarize`)."""
    import glob
    import gzip

    from trace_decode import device_events, hlo_scopes, summarize

    scopes = hlo_scopes(compiled.as_text())
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(cache))
        wall = time.perf_counter() - t0
    files = sorted(glob.glob(os.path.join(glob.escape(trace_dir), "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        return {"error": f"no trace under {trace_dir}"}
    with gzip.open(files[-1], "rt") as f:
        events, _ = device_events(json.load(f))
    return summarize(events, scopes, steps, wall)


def time_loop(fn, cache, q0, steps, reps, dump=None, trace_dir=None):
    # Only the hot set is carried (the one part of the cache a step changes): carrying the whole cache through
    # the loop makes XLA copy it, tier 2 included, on entry to every call (an artefact a decode loop that
    # donates its cache does not have: measured ~0.6 ms per step at 32K when amortised over 30 steps).
    @jax.jit
    def loop(cache):
        def body(i, carry):
            acc, hot = carry
            res, c = fn(q_at(q0, i), cache.replace(**hot))
            return acc + _reduce(res), hot_set(c)
        return jax.lax.fori_loop(0, steps, body, (jnp.zeros(()), hot_set(cache)))

    t0 = time.perf_counter()
    compiled = loop.lower(cache).compile()
    compile_s = time.perf_counter() - t0
    launches = count_launches(compiled.as_text())
    if dump:
        Path(dump).write_text(compiled.as_text())
    jax.block_until_ready(compiled(cache))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(cache))
        times.append(time.perf_counter() - t0)
    if trace_dir:
        launches["trace"] = trace_loop(compiled, cache, steps, trace_dir)
    return statistics.median(times) / steps * 1e6, launches, compile_s


def dense_loop_us(k, v, q0, lengths, steps, reps):
    @jax.jit
    def loop(k, v):
        def body(i, acc):
            return acc + step.dense_attention_f32(q_at(q0, i), k, v, lengths).astype(q0.dtype).astype(jnp.float32)
        return jax.lax.fori_loop(0, steps, body, jnp.zeros(q0.shape))

    jax.block_until_ready(loop(k, v))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(k, v))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["8b:32768", "smol:1024"], help="NAME:CONTEXT, NAME in "
                    + ",".join(LAYER_SHAPES))
    ap.add_argument("--tier1", nargs="+", default=["jnp"], choices=("jnp", "pallas", "fused"),
                    help="jnp; pallas (the tier-1 kernel); fused (the tier-1 kernel and the fused rung 0)")
    ap.add_argument("--phases", nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rung0-variants", nargs="+", default=None, metavar="CHUNKxWARPS",
                    help="for --tier1 fused: the certify kernel's pass width in blocks and warps per program, e.g. "
                    "256x4 2048x4 (each self-checked anew; default: the module's settings)")
    ap.add_argument("--trace", default=None, help="DIR: trace one more call of each fast phase (jax.profiler) and "
                    "add its kernels per step, by name and scope, to the row")
    ap.add_argument("--k-max", nargs="+", type=int, default=[8], help="the policy's k_max, each a run of its own "
                    "(the hot set keeps --hot-slots slots, so only the selection's work changes)")
    ap.add_argument("--hot-slots", type=int, default=8)
    ap.add_argument("--dump-hlo", default=None, help="write the compiled HLO of the fast phase to DIR/NAME_T_IMPL.hlo")
    args = ap.parse_args()
    dev = jax.devices()[0]
    rows = []
    for spec in args.shapes:
        name, T, G, k, v, q0 = random_layer(spec)
        B = 1
        kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        lengths = jnp.full((B,), T, jnp.int32)
        dense_us = dense_loop_us(kh, vh, q0, lengths, args.steps, args.reps)
        print(f"{name} T={T} dense {dense_us:.1f} us", flush=True)
        rows.append(dict(shape=name, context=T, phase="dense", tier1=None, us=dense_us))
        runs = [(impl, None) for impl in args.tier1 if impl != "fused" or not args.rung0_variants]
        runs += [("fused", v) for v in (args.rung0_variants or []) if "fused" in args.tier1]
        runs = [(impl, variant, km) for impl, variant in runs for km in args.k_max]
        for impl, variant, k_max in runs:
            policy = CertPolicy(tier1="jnp" if impl == "jnp" else "pallas", rung0="fused" if impl == "fused" else "jnp",
                                k_max=k_max, hot_slots=max(args.hot_slots, k_max))
            settings = set_rung0_variant(variant)
            cache = jax.jit(lambda k, v, p=policy: TieredKVCache.from_dense(k, v, p))(k, v)
            fused_ran = step.uses_fused_rung0(cache, policy) if impl == "fused" else None
            for ph, fn in phases(policy).items():
                if args.phases and ph not in args.phases:
                    continue
                if ph == "naive" and impl != args.tier1[0]:
                    continue
                label = impl + (f"[{variant}]" if variant else "") + (f"k{k_max}" if len(args.k_max) > 1 else "")
                dump = (f"{args.dump_hlo}/{name}_{T}_{label}.hlo" if args.dump_hlo and ph == "fast" else None)
                try:
                    traced = args.trace and ph in ("fast", "rung0")
                    tdir = f"{args.trace}/{name}_{T}_{label}_{ph}" if traced else None
                    us, launches, compile_s = time_loop(fn, cache, q0, args.steps, args.reps, dump, tdir)
                except Exception as e:  # noqa: BLE001 - one variant that fails must not cost the others
                    print(f"{name} T={T} {label} {ph} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    rows.append(dict(shape=name, context=T, phase=ph, tier1=impl, rung0=settings,
                                     error=f"{type(e).__name__}: {e}"[:800]))
                    continue
                print(f"{name} T={T} {label:14s} {ph:8s} {us:9.1f} us  launches {launches['launches']:4d} "
                      f"(+{launches['cond_branch_launches']} in branches)  compile {compile_s:.1f} s"
                      + ("" if fused_ran is None else f"  fused rung 0 ran: {fused_ran}"), flush=True)
                rows.append(dict(shape=name, context=T, phase=ph, tier1=impl, us=us, k_max=k_max,
                                 hot_slots=policy.hot_slots, launches=launches["launches"],
                                 cond_branch_launches=launches["cond_branch_launches"], compile_s=compile_s,
                                 rung0=settings, fused_rung0_ran=fused_ran, trace=launches.get("trace")))
    from pallas_kernels import tier1_pass

    result = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, steps=args.steps,
                  tier1_bps_rule=tier1_pass.FAST_PASS_BPS,
                  reps=args.reps, xla_flags=os.environ.get("XLA_FLAGS", ""), rows=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
