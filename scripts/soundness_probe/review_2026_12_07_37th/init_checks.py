"""What `TieredKVCache.init` refuses (zero sizes, a group size that does not divide head_dim, a head_dim that
cannot be packed) is still refused on the direct path (init runs inside `_convert_on_device`), with the same
message as a layer at a time.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_37th/init_checks.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax.numpy as jnp

from certattn_jax import cache as cm
from certattn_jax.policy import CertPolicy

REAL = cm.CONVERT_GROUP_BYTES
CASES = {"batch 0": ((0, 2, 48, 32), CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)),
         "heads 0": ((1, 0, 48, 32), CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)),
         "head_dim 24, group 16": ((1, 2, 48, 24), CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)),
         "head_dim 6 at K4V2": ((1, 2, 48, 6), CertPolicy(
             block_size=16, group_size=2, k_max=4, v_max=2, key_bits=4, value_bits=2)),
         "capacity 0": ((1, 2, 0, 32), CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2))}
for name, (shape, pol) in CASES.items():
    ks = tuple(jnp.ones(shape, jnp.float32) for _ in range(2))
    lens = jnp.zeros((shape[0],), jnp.int32)
    out = []
    for form, budget in (("batched", REAL), ("batched", 1)):
        cm.CONVERT_GROUP_FORM, cm.CONVERT_GROUP_BYTES = form, budget
        try:
            cm.TieredKVCache.stacked_from_layers(ks, ks, lens, pol)
            out.append("ok")
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")
    print(f"{name}:\n   direct: {out[0]}\n   layer : {out[1]}")
