"""Where the compile time of one decode step goes: lowering vs XLA compile, HLO size, per cache mode and layer count.

    PYTHONPATH=. python scripts/profile_compile.py --layers 2 4 --out results/compile_profile.json

Per (mode, layers) it jits one decode step (`models.llama.forward` on one token, the cache donated) for a tiny
LLaMA (hidden 64, 4 query / 2 KV heads, head_dim 32, capacity 256) and reports
  lower_s:   tracing + lowering to StableHLO
  compile_s: XLA compile of that module
  hlo_ops:   lines of the optimized HLO text that define an instruction (`=`), summed over all computations
  while / conditional / custom-call / fusion counts in the optimized HLO.
With --attention it also compiles one layer's attention alone: `certified_attention_step` (all rungs), the same
with only rung 0 (`build_context` + `evaluate_stage`, no lax.cond rungs), and `naive_attention`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def hlo_stats(compiled) -> dict:
    text = compiled.as_text()
    ops = [line for line in text.splitlines() if " = " in line and not line.lstrip().startswith("//")]
    count = {name: sum(1 for line in ops if re.search(rf"\b{name}\(", line))
             for name in ("while", "conditional", "custom-call", "fusion", "copy", "dynamic-update-slice")}
    return {"hlo_ops": len(ops), "hlo_chars": len(text), **count}


def timed_compile(fn, *args) -> dict:
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 3), **hlo_stats(compiled)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--modes", nargs="+",
                    default=["dense", "naive", "certified", "certified_two-pass", "certified_unrolled"])
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--attention", action="store_true", help="also compile one layer's attention alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from certattn_jax.attention import certified_attention_step, naive_attention
    from certattn_jax.cache import TieredKVCache
    from certattn_jax.model_cache import DEFAULT_SCHEDULE, cache_spec
    from certattn_jax.policy import CertPolicy
    from certattn_jax.step import build_context, evaluate_stage, exact_items
    from models import llama
    from models.config import LlamaConfig

    policy = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
    rows = []
    for L in args.layers:
        cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=L, num_heads=4,
                          num_kv_heads=2, head_dim=32, max_position_embeddings=4096)
        params = llama.init_params(cfg, jax.random.key(0), jnp.float32)
        tok = jnp.zeros((1, 1), jnp.int32)
        for mode in args.modes:
            # certified_<schedule>: TieredModelCache.schedule ("certified" = the default schedule)
            base, _, schedule = mode.partition("_")
            cache = cache_spec(base, cfg, jnp.float32, policy, schedule=schedule or DEFAULT_SCHEDULE)(1, args.capacity)
            step = jax.jit(lambda p, t, c, cfg=cfg: llama.forward(p, cfg, t, c), donate_argnums=(2,))
            stats = timed_compile(step, params, tok, cache)
            row = {"what": "decode_step", "mode": mode, "layers": L, **stats}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.attention:
        k = jax.random.normal(jax.random.key(1), (1, 200, 2, 32))
        cache = TieredKVCache.from_dense(k, k, policy, capacity=args.capacity)
        q = jax.random.normal(jax.random.key(2), (1, 4, 32))

        def rung0(q, c):
            ctx = build_context(q, c, policy)
            ids = jnp.zeros(c.hot_ids.shape, jnp.int32)

            hot = exact_items(ctx, c.hot_k, c.hot_v, ids, ids >= 0)
            return evaluate_stage(ctx, [hot], q.dtype, policy).out

        variants = {"certified_all_rungs": lambda q, c: certified_attention_step(q, c, policy)[0],
                    "certified_rung0_only": rung0,
                    "naive": lambda q, c: naive_attention(q, c)}
        for name, fn in variants.items():
            row = {"what": "attention_1_layer", "mode": name, **timed_compile(jax.jit(fn), q, cache)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"backend": jax.default_backend(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
