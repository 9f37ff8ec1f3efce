"""Host time of what a tiered prefill does besides the prefill and the conversion: the two `jax.eval_shape`
traces of the cache's init that `kernel_checks.start` makes (where kernels are compiled: every prefill until the
thirty-seventh session, once per configuration since), timed warm, repeated.

    python scripts/probe_prefill_host_work.py --out results/probe_prefill_host_work_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-heads", type=int, default=3)  # SmolLM2
    ap.add_argument("--capacity", type=int, default=1280)  # a 1K prompt + 64 new tokens
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from certattn_jax.cache import TieredKVCache
    from certattn_jax.policy import CertPolicy
    from pallas_kernels import selftest

    policy = CertPolicy()

    def init(layers):
        return TieredKVCache.init(batch=1, capacity=args.capacity, num_kv_heads=args.kv_heads,
                                  head_dim=args.head_dim, dtype=jnp.bfloat16, policy=policy, layers=layers)

    shapes, views = [], []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        jax.eval_shape(lambda: init(1))
        t1 = time.perf_counter()
        jax.eval_shape(lambda: selftest.as_layer_view(init(None)))
        shapes.append(t1 - t0)
        views.append(time.perf_counter() - t1)
    ms = lambda xs: round(1e3 * statistics.median(xs[1:]), 2)  # noqa: E731 -- the first (cold) left out
    row = {"backend": jax.default_backend(), "jax": jax.__version__, "repeats": args.repeats,
           "eval_shape_init_ms": ms(shapes), "eval_shape_layer_view_ms": ms(views),
           "max_ms": round(1e3 * max(a + b for a, b in zip(shapes[1:], views[1:], strict=True)), 2)}
    print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **row}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
