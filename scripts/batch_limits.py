"""The largest batch each cache can hold on a machine, from the caches' own shapes (`jax.eval_shape`: nothing is
allocated, so it runs anywhere).

    PYTHONPATH=. python scripts/batch_limits.py --out results/batch_limits_h200.json

Issue 8 asks whether tier 1 at ~44 % of dense lets the certified cache hold batches the dense cache cannot. Two
budgets decide it:
  device  device memory - the model's weights - a margin (activations, workspace): dense K/V, or tier 1;
  host    host RAM - a margin: tier 2 (the bf16 originals) lives in pinned host memory, which cannot exceed
          the machine's physical memory.
Defaults: the device tool's H200 machine (139 GiB of GPU memory, 128 GiB of host memory; the device README).
Per model, context and cache: bytes per sequence on the device and on the host, the largest batch each budget
allows, and which budget binds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30


def per_sequence_bytes(mode: str, config, capacity: int, dtype="bfloat16") -> tuple[int, int]:
    """(device bytes, host bytes) of one sequence's cache of `capacity` tokens in `mode`."""
    import jax
    import jax.numpy as jnp

    from certattn_jax.model_cache import cache_spec

    shapes = jax.eval_shape(lambda: cache_spec(mode, config, jnp.dtype(dtype))(1, capacity))
    device = host = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        n = int(leaf.size) * leaf.dtype.itemsize
        if "host_" in jax.tree_util.keystr(path):  # tier 2: host_k, host_v
            host += n
        else:
            device += n
    return device, host


def weight_bytes(config, dtype="bfloat16") -> int:
    import jax
    import jax.numpy as jnp

    from models import llama

    shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0), jnp.dtype(dtype)))
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def limits(model: str, contexts: list[int], device_gib: float, host_gib: float, device_margin_gib: float,
           host_margin_gib: float) -> list[dict]:
    from scripts.bench_generate import _model_config

    cfg = _model_config(model)
    weights = weight_bytes(cfg)
    device_budget = device_gib * GIB - weights - device_margin_gib * GIB
    host_budget = (host_gib - host_margin_gib) * GIB
    rows = []
    for T in contexts:
        for mode in ("dense", "naive", "certified"):
            dev, host = per_sequence_bytes(mode, cfg, T)
            by_device = int(device_budget // dev)
            by_host = int(host_budget // host) if host else None
            batch = by_device if by_host is None else min(by_device, by_host)
            rows.append({"model": model, "context": T, "cache": mode, "device_gib_per_seq": round(dev / GIB, 3),
                         "host_gib_per_seq": round(host / GIB, 3), "max_batch_by_device": by_device,
                         "max_batch_by_host": by_host, "max_batch": batch,
                         "binding": "device" if by_host is None or by_device <= by_host else "host"})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama3.1-8b"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--device-gib", type=float, default=139.0)
    ap.add_argument("--host-gib", type=float, default=128.0)
    ap.add_argument("--device-margin-gib", type=float, default=4.0)
    ap.add_argument("--host-margin-gib", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [r for m in args.models for r in limits(m, args.contexts, args.device_gib, args.host_gib,
                                                   args.device_margin_gib, args.host_margin_gib)]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps({"device_gib": args.device_gib, "host_gib": args.host_gib,
                                              "device_margin_gib": args.device_margin_gib,
                                              "host_margin_gib": args.host_margin_gib, "rows": rows}, indent=1)
                                  + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
