"""Targeted soundness families (an independent review, 2026-12-06), each decode step checked head by head against
float64 (audit2.run_config):
  extremes       keys / values at +-0.999 of the cache dtype's largest value within one block and channel, and
                 queries x1e37;
  block_const    values constant within each block at quantization midpoints, with a zero or tiny query (the
                 tightest case: bound / error 1.0001-1.0008, the INT block's mass times its mean value error).

    PYTHONPATH=. python scripts/soundness_probe/targeted.py [extremes|block_const ...]   # default: both
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax.numpy as jnp
import numpy as np
from audit2 import run_config

from certattn_jax.policy import CertPolicy as P

f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
# name: (families, seeds per family, [(B, H, G, D, cache dtype, query dtype, policy, initial lengths)])
SETS = {
    "extremes": (("k_extreme", "v_extreme", "kv_extreme", "q_extreme", "k_extreme_same_sign"), 2, [
        (2, 2, 2, 32, f32, f32, P(block_size=16, group_size=16, key_bits=8, value_bits=4, k_max=2, eps=0.05), [40, 7]),
        (2, 1, 4, 32, bf16, bf16, P(block_size=32, group_size=32, key_bits=4, value_bits=2, k_max=1, eps=0.5),
         [64, 130]),
        (1, 2, 1, 16, f16, f32, P(block_size=16, group_size=16, key_bits=4, value_bits=2, k_max=2, eps=0.5), [100])]),
    "block_const": (("val_block_const", "val_block_const_q0", "val_block_const_off"), 3, [
        (2, 2, 2, 32, f32, f32, P(block_size=16, group_size=16, key_bits=8, value_bits=4, k_max=1, eps=0.5), [40, 97]),
        (2, 1, 4, 32, bf16, f32, P(block_size=32, group_size=32, key_bits=8, value_bits=2, k_max=1, eps=0.5),
         [64, 130]),
        (1, 2, 1, 16, f16, f32, P(block_size=16, group_size=16, key_bits=4, value_bits=2, k_max=2, eps=0.5), [100])]),
}


def main(names: list[str]) -> int:
    heads = violations = 0
    for name in names:
        families, seeds, configs = SETS[name]
        for i, (B, H, G, D, dt, qdt, pol, L0) in enumerate(configs):
            for fam in families:
                for seed in range(seeds):
                    s = run_config(B=B, H=H, G=G, D=D, dtype=dt, qdtype=qdt, policy=pol, L0=L0, T=20, family=fam,
                                   seed=seed + 50 * i)
                    heads, violations = heads + s["heads"], violations + s["viol"]
                    r = np.asarray(s["ratios"])
                    print(name, i, fam, seed, s["heads"], s["viol"], s["rungs"], r.min() if r.size else None,
                          s["examples"][:2], flush=True)
    print("total head-steps", heads, "violations", violations)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(SETS)))
