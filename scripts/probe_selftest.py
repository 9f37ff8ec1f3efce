"""Run the compiled kernels' known-answer checks (`pallas_kernels.selftest`) over a grid of cache layouts and
record each verdict (None = agrees with its jnp reference; else what disagrees), with the compile+check time.

    python scripts/probe_selftest.py --out results/probe_selftest_h200.json        # on the GPU

On the H200 (2026-12-01) the soundness suite's k_max = 1 configuration of the fused rung 0 disagreed with its
reference (the check routed it to jnp); this maps which layouts the compiled kernels get wrong.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--k-max", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--out", default=str(ROOT / "results/probe_selftest.json"))
    args = ap.parse_args(argv)
    import jax

    from pallas_kernels import selftest

    rows = []
    for bs, d in itertools.product(args.block_sizes, args.head_dims):
        cfg = dict(block_size=bs, head_dim=d, group_size=min(32, d // 2) if d >= 32 else d, key_bits=8,
                   value_bits=4)
        t0 = time.perf_counter()
        try:
            found = selftest.tier1_disagreement(**cfg)
        except Exception as e:  # noqa: BLE001 -- a compile failure is a verdict too
            found = f"raised {type(e).__name__}: {e}"[:500]
        rows.append({"kernel": "tier1", **cfg, "disagreement": found, "seconds": round(time.perf_counter() - t0, 2)})
        print(json.dumps(rows[-1]), flush=True)
        for k in args.k_max:
            t0 = time.perf_counter()
            try:
                found = selftest.rung0_disagreement(**cfg, k_max=k)
            except Exception as e:  # noqa: BLE001
                found = f"raised {type(e).__name__}: {e}"[:500]
            rows.append({"kernel": "rung0_fused", **cfg, "k_max": k, "disagreement": found,
                         "seconds": round(time.perf_counter() - t0, 2)})
            print(json.dumps(rows[-1]), flush=True)
            Path(args.out).write_text(json.dumps({"device": str(jax.devices()[0].device_kind),
                                                  "jax": jax.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
