"""How often does a real model's certified decode step need rung 1, and does rung 1 need tier 2?

    python scripts/probe_rung1.py --length 1024 --steps 32 --samples 2 --out results/probe_rung1_cpu.json

SmolLM2-135M-Instruct on big.txt windows (the eval's prose), certified cache with the default policy, the
prompt prefilled and then `steps` tokens teacher-forced through decode steps. Counted, per layer-step where some
head fails rung 0 (rung 1's branch runs): the KV heads that widen, and those among them whose top 2 k_max
candidates are not all resident (rung 1 reads tier 2). Per step: whether any head of any layer left rung 0 --
the share of steps that the "straight" schedule (a fast pass at rung 0 only) would send to its second pass; and
the end-of-step hot-set refreshes (deferred / prefetch, `TieredKVCache.apply_pending_hot_sets`) with the blocks
they read from tier 2.
The answer decides whether rung 1's resident part belongs in a conditional-free fast pass
(docs/performance.md, 2026-12-01 fifth session).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=32, help="teacher-forced decode steps")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--k-max", type=int, default=None)
    ap.add_argument("--hot-slots", type=int, default=None, help="CertPolicy.hot_slots (default: k_max)")
    ap.add_argument("--tau-cov", type=float, default=None, help="CertPolicy.tau_cov (default: the library's)")
    ap.add_argument("--schedule", default=None, help="the cache's layer schedule (default: the library's)")
    ap.add_argument("--out", default=str(ROOT / "results/probe_rung1.json"))
    args = ap.parse_args(argv)

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from certattn_jax import ladder, select
    from certattn_jax import policy as policy_impls
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.evals import decode, ppl
    from certattn_jax.model_cache import adaptive_rung0_streak
    from certattn_jax.policy import CertPolicy
    from models import llama
    from models.pretrained import load_pretrained

    events = []  # (kv heads widening, of which reading tier 2) per rung-1 branch run

    def record(widen, fetch):
        events.append((int(widen), int(fetch)))

    real = ladder.rung1_widen

    def counted(ctx, cache, sel, failing, out_dtype, policy, **kw):
        need = jnp.any(failing, axis=-1)  # [B, H]
        fetch = need & jnp.any(sel.wide_missing >= 0, axis=-1)
        jax.debug.callback(record, jnp.sum(need), jnp.sum(fetch))
        return real(ctx, cache, sel, failing, out_dtype, policy, **kw)

    refreshed = []  # blocks read from tier 2 by each end-of-step refresh (deferred / prefetch hot sets)
    real_apply = TieredKVCache.apply_pending_hot_sets

    def counted_apply(self):
        _, _, fetch_into = select.plan_residency(self.hot_ids, self.hot_pending, self.hot_used)
        jax.debug.callback(lambda n: refreshed.append(int(n)), jnp.sum(fetch_into >= 0))
        return real_apply(self)

    ladder.rung1_widen = counted
    TieredKVCache.apply_pending_hot_sets = counted_apply
    pre = load_pretrained(args.model, dtype=jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    policy = CertPolicy()
    policy = policy if args.k_max is None else dataclasses.replace(policy, k_max=args.k_max)
    policy = policy if args.hot_slots is None else dataclasses.replace(policy, hot_slots=args.hot_slots)
    policy = policy if args.tau_cov is None else dataclasses.replace(policy, tau_cov=args.tau_cov)
    rows, windows = [], []

    def fresh():
        return decode.make_cache("certified", pre.params, pre.config, args.length + args.steps + 64, policy,
                                 schedule=args.schedule)

    for i, ids in enumerate(ppl.windows(pre.tokenizer, args.length + args.steps + 1, args.samples, seed=3)):
        ids = np.asarray(ids, np.int32)
        cache = fresh()
        cache, _ = decode.prefill(pre.params, pre.config, cache, ids[:args.length])
        assert cache.inner.store.hot_ids.shape[-1] == policy.slots
        inputs = jnp.asarray(ids[args.length:args.length + args.steps])[None]
        targets = jnp.asarray(ids[args.length + 1:args.length + args.steps + 1])[None]
        steps_rungs = []

        def sink(step, rec, out=steps_rungs):
            out.append(np.asarray(rec["cert"].rung))

        decode.set_sink(sink)
        before, before_refresh = len(events), len(refreshed)
        decode.teacher_forced(pre.params, pre.config, cache, inputs, targets, stream=True)
        jax.effects_barrier()
        decode.set_sink(None)
        rungs = np.stack(steps_rungs)  # [steps, L, B, Hq]
        ev = np.asarray(events[before:] or [(0, 0)])
        H, L = pre.config.num_kv_heads, pre.config.num_layers
        rows.append({"sample": i, "steps": int(rungs.shape[0]), "head_steps": int(rungs.size),
                     "rung_histogram": [int(np.sum(rungs == r)) for r in range(5)],
                     "steps_leaving_rung0": int(np.sum(np.any(rungs > 0, axis=(1, 2, 3)))),
                     "layer_steps_with_rung1_branch": int(len(events) - before),
                     "layer_steps": int(rungs.shape[0] * L),
                     "kv_head_widenings": int(ev[:, 0].sum()), "kv_head_widenings_reading_tier2": int(ev[:, 1].sum()),
                     "kv_head_layer_steps": int(rungs.shape[0] * L * H),
                     "end_of_step_refreshes": int(len(refreshed) - before_refresh),
                     "end_of_step_blocks_read": int(sum(refreshed[before_refresh:]))})
        print(json.dumps(rows[-1]), flush=True)
        windows.append((ids, inputs, targets))

    # Timing, without the counting callbacks (recompiled): the first window's steps, compiled once, then timed
    ladder.rung1_widen = real
    TieredKVCache.apply_pending_hot_sets = real_apply
    jax.clear_caches()
    ids, inputs, targets = windows[0]
    times = []
    for _ in range(2):
        cache, _ = decode.prefill(pre.params, pre.config, fresh(), ids[:args.length])
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        nll, _, done = decode.teacher_forced(pre.params, pre.config, cache, inputs, targets)
        jax.block_until_ready(nll)
        times.append(time.perf_counter() - t0)
    slow_steps = int(done.inner.slow_steps)  # of the timed window's steps, answered by the whole ladder
    Path(args.out).write_text(json.dumps({"model": args.model, "device": str(jax.devices()[0].device_kind),
                                          "jax": jax.__version__, "length": args.length, "k_max": policy.k_max,
                                          "hot_slots": policy.slots, "hot_refresh": policy.hot_refresh,
                                          "schedule": args.schedule or "default",
                                          "looped_weights": llama.looped_weights(pre.params),
                                          "fetch_unroll_up_to": select.FETCH_UNROLL_UP_TO,
                                          "fetch_whole_below_bytes": select.FETCH_WHOLE_LAYER_BELOW_BYTES,
                                          "fetch_kernel": cache.inner.store.reads_tier2_by_kernel(),
                                          "tau_cov": policy.tau_cov, "eps": policy.eps,
                                          "rung0": policy.rung0, "tier1": policy.tier1,
                                          "rung0_impl": policy_impls.rung0_impl(
                                              policy.rung0, cache.inner.store.num_blocks),
                                          "tier1_impl": policy_impls.tier1_impl(policy.tier1),
                                          "decode_ms_per_step": round(times[-1] * 1e3 / args.steps, 3),
                                          "second_pass_steps": slow_steps,
                                          "adaptive_streak": adaptive_rung0_streak(),
                                          "decode_timing": "window 0's steps teacher-forced again, compiled, no "
                                                           "records or counting callbacks",
                                          "rows": rows}, indent=1))
    print(json.dumps({"decode_ms_per_step": round(times[-1] * 1e3 / args.steps, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
