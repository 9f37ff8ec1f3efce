import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax.numpy as jnp
import numpy as np
from audit2 import run_config

from certattn_jax.policy import CertPolicy

P = CertPolicy
cfgs = [
    (2, 2, 2, 32, jnp.float32, P(block_size=16, group_size=16, key_bits=8, value_bits=4, k_max=1, eps=0.5), [40, 97]),
    (2, 1, 4, 32, jnp.bfloat16, P(block_size=32, group_size=32, key_bits=8, value_bits=2, k_max=1, eps=0.5), [64, 130]),
    (1, 2, 1, 16, jnp.float16, P(block_size=16, group_size=16, key_bits=4, value_bits=2, k_max=2, eps=0.5), [100]),
]
for i, (B, H, G, D, dt, pol, L0) in enumerate(cfgs):
    for fam in ("val_block_const", "val_block_const_q0", "val_block_const_off"):
        for seed in range(3):
            s = run_config(
                B=B,
                H=H,
                G=G,
                D=D,
                dtype=dt,
                qdtype=jnp.float32,
                policy=pol,
                L0=L0,
                T=20,
                family=fam,
                seed=seed + 50 * i,
            )
            r = np.asarray(s["ratios"])
            print(
                i,
                fam,
                seed,
                s["heads"],
                s["viol"],
                s["rungs"],
                r.min() if r.size else None,
                s["examples"][:1],
                flush=True,
            )
