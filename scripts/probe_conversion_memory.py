"""XLA's memory analysis of one conversion program (`cache._convert_layers_into`) per group size and form: the
temporaries in bytes per K/V element of the group, against `cache.conversion_temp_bytes`'s estimate (what
`auto_staging_batch` plans with). Compiles only; on the CPU this is XLA:CPU's analysis.

    python scripts/probe_conversion_memory.py --out results/probe_conversion_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--groups", default="1,2,4,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from certattn_jax import cache as cm
    from certattn_jax.policy import CertPolicy

    policy = cm.conversion_layout(CertPolicy())
    dtype = jnp.dtype(args.dtype)
    B, H, S, d = 1, args.kv_heads, args.capacity, args.head_dim
    groups = [int(g) for g in args.groups.split(",")]
    layers = max(groups)
    elems = 2 * B * H * S * d  # one layer's K and V
    store = cm.TieredKVCache.init(batch=B, capacity=S, num_kv_heads=H, head_dim=d, dtype=dtype, policy=policy,
                                  layers=layers)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    rows = []
    for form in cm.CONVERT_GROUP_FORMS:
        for g in groups:
            kv = tuple(jax.ShapeDtypeStruct((B, H, S, d), dtype) for _ in range(g))
            temp = cm._convert_layers_into.lower(store, kv, kv, jax.ShapeDtypeStruct((B,), jnp.int32), scalar,
                                                 policy, scalar, form=form).compile().memory_analysis()
            budget, cm.CONVERT_GROUP_BYTES = cm.CONVERT_GROUP_BYTES, g * elems * dtype.itemsize
            try:
                estimate = cm.conversion_temp_bytes(elems, layers, dtype.itemsize, form=form)
            finally:
                cm.CONVERT_GROUP_BYTES = budget
            row = {"form": form, "layers_per_program": g, "temp_bytes": temp.temp_size_in_bytes,
                   "bytes_per_group_element": round(temp.temp_size_in_bytes / (g * elems), 2),
                   "bytes_per_layer_element": round(temp.temp_size_in_bytes / elems, 2), "estimate_bytes": estimate}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "backend": jax.default_backend(),
                                              "jax": jax.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
