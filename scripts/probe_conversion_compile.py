"""Cold (compile + run) and warm seconds of the eager conversion (`TieredKVCache.stacked_from_layers`) at a model's
shape, a layer per program against the default layer groups (`cache.CONVERT_GROUP_BYTES`), and the groups in
either form of their program (`CERTATTN_CONVERT_GROUP_FORM` batched / loop), each in a process of its own so that
nothing compiled is shared.

    python scripts/probe_conversion_compile.py --layers 30 --kv-heads 3 --capacity 1280 --head-dim 64   # SmolLM2 1K
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _one(args: argparse.Namespace, group_bytes: int | None) -> dict:
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    from certattn_jax import cache as cache_mod
    from certattn_jax.cache import TieredKVCache, conversion_group_layers
    from certattn_jax.policy import CertPolicy

    if group_bytes is not None:
        cache_mod.CONVERT_GROUP_BYTES = group_bytes
    dtype = jnp.dtype(args.dtype)
    shape = (1, args.kv_heads, args.capacity, args.head_dim)
    key = jax.random.key(0)
    ks = tuple(jax.random.normal(jax.random.fold_in(key, i), shape, dtype) for i in range(args.layers))
    vs = tuple(jax.random.normal(jax.random.fold_in(key, 1000 + i), shape, dtype) for i in range(args.layers))
    lengths = jnp.array([args.capacity - 64], jnp.int32)
    jax.block_until_ready((ks, vs))
    t0 = time.perf_counter()
    jax.block_until_ready(TieredKVCache.stacked_from_layers(ks, vs, lengths, CertPolicy()))
    t1 = time.perf_counter()
    jax.block_until_ready(TieredKVCache.stacked_from_layers(ks, vs, lengths, CertPolicy()))
    t2 = time.perf_counter()
    return {"layers_per_program": conversion_group_layers(ks[0].nbytes + vs[0].nbytes, args.layers),
            "group_form": cache_mod.CONVERT_GROUP_FORM,
            "cold_s": round(t1 - t0, 3), "warm_s": round(t2 - t1, 4), "backend": jax.default_backend()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=1280)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--group-bytes", type=int, default=None, help=argparse.SUPPRESS)  # one row, in-process
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.group_bytes is not None:
        print(json.dumps(_one(args, args.group_bytes or None)))
        return 0
    rows = {}
    for name, budget, form in (("layer_at_a_time", 1, None), ("default_groups", 0, None),
                               ("batched_groups", 0, "batched"), ("loop_groups", 0, "loop")):
        cmd = [sys.executable, __file__, "--group-bytes", str(budget)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("group_bytes", "out")]
        env = dict(os.environ, **({"CERTATTN_CONVERT_GROUP_FORM": form} if form else {}))
        rows[name] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                               env=env).stdout.splitlines()[-1])
        print(name, rows[name], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
