"""Where the fused rung 0's extra compile time goes: each piece of `step.rung0_fused` compiled on its own.

Issue 7's compile target (certified decode compile <= 2x dense + 10 s) is met with the jnp rung 0 and missed
with the fused one (~30 s against 12-13 s on the H200, docs/performance.md). This probe times, per shape and
hot-set size, the XLA compile (`jit(...).lower(...).compile()`, which includes Triton's compile of the Pallas
kernels) of:

    rung0_fused   the whole fused rung 0 (tier-1 pass with its slot programs + certify kernel + XLA glue)
    items         the tier-1 pass alone, as the fused rung 0 calls it (`step.fused_items`)
    certify       the certify kernel alone, on those items (`pallas_kernels.certify_rung0`)
    tier1_plain   the tier-1 pass as the jnp rung 0 calls it (`step.tier1_partials`)
    rung0_fused_again  the whole again, last: shows whether a process-level cache hides compile work

    python scripts/probe_kernel_compile.py --shapes smol:1024 8b:32768 --k-max 8 2 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _device_timing import random_layer  # noqa: E402

from certattn_jax import step  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402


def compile_seconds(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t0


def certify_only(policy: CertPolicy):
    """The certify kernel on the items `fused_items` produced (passed in as arrays, so only it compiles)."""
    from pallas_kernels import certify_rung0 as ck

    def items(q, c):
        qt = step.query_terms(q, c)
        it = step.fused_items(qt, c, policy, True)
        vt = step.value_terms(c, policy, step.block_validity(c))
        extra = it.apx.m.shape[-1] - c.num_blocks

        def blocks(x):  # the value error annotations per KV head, padded to the kernel's block columns
            return jnp.pad(x, ((0, 0), (0, 0), (0, extra)))

        return (it.apx.m, it.apx.l, it.apx.acc, it.apx_delta, blocks(vt.eta), blocks(vt.eta_mean),
                blocks(vt.eta_op), c.flushed // c.block_size, c.hot_ids, it.slots.m, it.slots.l, it.slots.acc,
                it.slot_delta, c.lengths - c.flushed, vt.key_scale, it.split_args, it.padded_rows)

    def certify(args, G, nb):
        *pos, split_args, _ = args
        return ck.certify_rung0(*pos, block_size=policy.block_size, k_max=policy.k_max, tau_cov=policy.tau_cov,
                                rank_margin=policy.rank_margin, heads=G, num_blocks=nb, **split_args)

    return items, certify


def probe(k: jax.Array, v: jax.Array, q: jax.Array, G: int, k_max: int) -> dict:
    """Compile seconds of each piece for keys/values [1, T, H, d], query [1, H*G, d], hot set k_max."""
    policy = CertPolicy(tier1="pallas", rung0="fused", k_max=k_max)
    cache = jax.jit(lambda k, v: TieredKVCache.from_dense(k, v, policy))(k, v)

    def whole(q, c):
        return step.rung0_fused(q, c, policy).stage

    def tier1_plain(q, c):
        return step.tier1_partials(step.query_terms(q, c).q_scaled, c, step.block_validity(c), "pallas")

    items, certify = certify_only(policy)
    row = dict(k_max=k_max, num_blocks=cache.num_blocks, rung0_fused=compile_seconds(whole, q, cache),
               items=compile_seconds(items, q, cache))
    row["certify"] = compile_seconds(lambda a: certify(a, G, cache.num_blocks), jax.jit(items)(q, cache))
    row["tier1_plain"] = compile_seconds(tier1_plain, q, cache)
    row["rung0_fused_again"] = compile_seconds(lambda q, c: whole(q, c), q, cache)  # a new function: no jit cache hit
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["smol:1024", "8b:32768"])
    ap.add_argument("--k-max", nargs="+", type=int, default=[8])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = jax.devices()[0]
    rows = []
    for spec in args.shapes:
        name, T, G, k, v, q = random_layer(spec)
        for k_max in args.k_max:
            row = dict(shape=name, context=T, **probe(k, v, q, G, k_max))
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out:  # after every row: a call stopped at its limit keeps what finished
                result = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, rows=rows)
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
