"""Where a tiered decode loop's compile time goes: the loop compiled whole, then with one part left out at a time.

    python scripts/probe_compile_parts.py --model llama3.1-8b --capacity 8256 --modes dense naive certified \
        --out results/probe_compile_parts.json

The decode loop of `models.generate` for the model's shapes (abstract weights: nothing is allocated for them,
only compiled), one cache per mode at `--capacity`. For each tiered mode it is lowered and compiled as is, and
again with one part replaced by a no-op (the program is then wrong; only its compile time is of interest):
  flush          the once-per-step block flush (quantize a full residual block of every layer, tier-2 write)
  hot_refresh    the deferred hot-set refresh (`apply_pending_hot_sets`: tier-2 fetches into the hot set)
  second_pass    the whole ladder's second pass (its predicate made a constant False, so XLA drops the branch)
Each row: lower_s (tracing and lowering), compile_s (XLA), stablehlo_chars. The difference to the whole loop is
the part's share. Compile times vary by a few per cent between runs; on a GPU they include XLA's autotuning.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("flush", "hot_refresh", "second_pass")


@contextlib.contextmanager
def _without(part: str | None):
    """Replace `part` by a no-op while the loop is traced."""
    import jax.numpy as jnp

    from certattn_jax.cache import TieredKVCache
    from certattn_jax.model_cache import TieredModelCache

    patches = {
        None: [],
        "flush": [(TieredKVCache, "flush_unconditionally", lambda self, full: self)],
        "hot_refresh": [(TieredKVCache, "apply_pending_hot_sets", lambda self: self)],
        "second_pass": [(TieredModelCache, "needs_slow_path", lambda self: jnp.bool_(False))],
    }[part]
    saved = [(cls, name, getattr(cls, name)) for cls, name, _ in patches]
    try:
        for cls, name, fn in patches:
            setattr(cls, name, fn)
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def _compile(cfg, params, cache, part: str | None) -> dict:
    import jax
    import jax.numpy as jnp

    from models import generate as gen

    args = (gen.params_for_decoding(params, cache), cache, jnp.zeros((cache.lengths.shape[0], cfg.vocab_size),
                                                                      jnp.float32),
            jnp.int32(8), jnp.asarray([2], jnp.int32), jax.random.key(0), jnp.float32(0), jnp.float32(1))
    fn = jax.jit(functools.partial(gen.decode_loop, config=cfg, greedy=True, record=False), donate_argnums=(1,))
    with _without(part):
        t0 = time.perf_counter()
        lowered = fn.lower(*args)
        t1 = time.perf_counter()
        chars = len(lowered.as_text())
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
    return {"without": part, "lower_s": round(t1 - t0, 2), "compile_s": round(t3 - t2, 2), "stablehlo_chars": chars}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--capacity", type=int, default=1152)
    ap.add_argument("--modes", nargs="+", default=["dense", "naive", "certified"])
    ap.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS,
                    help="parts to leave out one at a time (none: only the whole loops)")
    ap.add_argument("--schedule", default="auto")
    ap.add_argument("--rung0", nargs="+", default=["auto"], choices=["auto", "jnp", "fused"],
                    help="rung-0 implementations (CertPolicy.rung0) to compile the tiered modes with, rows for each")
    ap.add_argument("--out", default=str(ROOT / "results/probe_compile_parts.json"))
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from certattn_jax.model_cache import cache_spec
    from certattn_jax.policy import CertPolicy
    from models import llama
    from scripts.bench_generate import _model_config

    cfg = _model_config(args.model)
    dtype = jnp.bfloat16
    params = jax.eval_shape(lambda: llama.fuse_projections(llama.init_params(cfg, jax.random.key(0), dtype)))
    doc = {"model": args.model, "capacity": args.capacity, "backend": jax.default_backend(),
           "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    for mode in args.modes:
        for rung0 in (["-"] if mode == "dense" else args.rung0):
            policy = None if mode == "dense" else CertPolicy(rung0=rung0)
            cache = cache_spec(mode, cfg, dtype, policy, schedule=args.schedule)(1, args.capacity)
            for part in [None] + ([] if mode == "dense" else args.parts):
                if part == "second_pass" and mode != "certified":
                    continue
                row = {"mode": mode, "rung0": None if policy is None else rung0,
                       "schedule": getattr(cache, "schedule", None), **_compile(cfg, params, cache, part)}
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
            del cache
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
