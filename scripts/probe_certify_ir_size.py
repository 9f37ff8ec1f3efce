"""Size of the certify kernel's Triton IR (the fused rung 0, `pallas_kernels.certify_rung0`), lowered for CUDA on
any machine (no GPU needed): a proxy for its Triton compile time, which grew with k_max while its loops were
unrolled (docs/performance.md, 2026-12-02 third session).

    JAX_PLATFORMS=cpu python scripts/probe_certify_ir_size.py --out results/certify_ir_size_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["CERTATTN_PALLAS_INTERPRET"] = "0"  # lower the compiled kernel, not the interpreted one

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import certify_rung0 as ck  # noqa: E402

# (name, query heads G, key blocks nb, head dim d): SmolLM2 1K, the 8B shape at 32K and 128K (block size 64)
SHAPES = [("smol_1k", 3, 16, 64), ("8b_32k", 4, 512, 128), ("8b_128k", 4, 2048, 128)]


def ir_chars(G: int, nb: int, d: int, hot_slots: int, k_max: int) -> int:
    """Characters of the serialized Triton IR in the exported module (split layout, one sequence, 8 KV heads)."""
    B, H, Sp = 1, 8, 16
    Gp, NBp, P = 1 << (G - 1).bit_length(), ck.padded_blocks(nb), ck.padded_slots(hot_slots)

    def z(*shape):
        return jnp.zeros(shape, jnp.float32)

    # m, l, acc, delta, then eta / eta_mean / eta_op per KV head
    args = (z(B, H, Gp, NBp), z(B, H, Gp, NBp), z(B, H, Gp, Sp, d), z(B, H, Gp, NBp), z(B, H, NBp), z(B, H, NBp),
            z(B, H, NBp), jnp.zeros((B,), jnp.int32), jnp.zeros((B, H, hot_slots), jnp.int32), z(B, H, Gp, P),
            z(B, H, Gp, P), z(B, H, Gp, P, d), z(B, H, Gp, P), jnp.zeros((B,), jnp.int32), z(B, H))
    split = dict(split_max=z(B, H, Gp, Sp), hot_acc=z(B, H, Gp, hot_slots, d))
    f = jax.jit(lambda *a: ck.certify_rung0(*a, block_size=64, k_max=k_max, tau_cov=0.995, rank_margin=0.1,
                                            heads=G, num_blocks=nb, interpret=False, **split))
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(f, platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()
    return sum(len(x) for x in re.findall(r'ir = "([^"]*)"', text))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k-max", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    rows = []
    for name, G, nb, d in SHAPES:
        for k in args.k_max:
            for slots in sorted({k, 8}):  # the default hot set (k_max slots) and 8 slots
                rows.append(dict(shape=name, k_max=k, hot_slots=slots, ir_chars=ir_chars(G, nb, d, slots, k)))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"jax": jax.__version__, "code": commit.strip(), "rows": rows},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
