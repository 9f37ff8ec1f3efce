"""Does XLA:CPU hoist a float32 copy of the whole stacked group out of the lax.map loop (what the per-layer
program was introduced to avoid, docs/performance.md fourteenth session)? Looks for float32 arrays of the stacked
group's shape [g, n, H, S, d] (or larger) in the optimized HLO of `_convert_layers_into`.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_groups/hoist_check.py
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

from certattn_jax import cache as cm
from certattn_jax.cache import TieredKVCache
from certattn_jax.policy import CertPolicy

g, n, H, S, d = 6, 1, 3, 1088, 64
pol = CertPolicy()
store = TieredKVCache.init(batch=n, capacity=S, num_kv_heads=H, head_dim=d, dtype=jnp.bfloat16, policy=pol, layers=g)
kv = jax.ShapeDtypeStruct((n, H, S, d), jnp.bfloat16)
i32 = jax.ShapeDtypeStruct((), jnp.int32)
hlo = cm._convert_layers_into.lower(store, (kv,) * g, (kv,) * g, jax.ShapeDtypeStruct((n,), jnp.int32), i32,
                                    store.layout_policy(), i32).compile().as_text()
big = sorted({m for m in re.findall(r"f32\[[0-9,]+\]", hlo)
              if eval(m[4:-1].replace(",", "*") or "1") >= g * n * H * S * d})
print("float32 arrays at least the stacked group's size:", big or "none")
print("bf16 stacked group:", sorted(set(re.findall(rf"bf16\[{g},{n},{H},{S},{d}\]", hlo))))
for line in hlo.splitlines():
    if "f32[6,1,3,1088,64]" in line or "f32[6,1,3,17,64,64]" in line:
        print("  ", line.strip()[:260])
ma = cm._convert_layers_into.lower(store, (kv,) * g, (kv,) * g, jax.ShapeDtypeStruct((n,), jnp.int32), i32,
                                   store.layout_policy(), i32).compile().memory_analysis()
print("temp MiB", ma.temp_size_in_bytes / 2**20, "group bf16 K/V MiB", 2 * g * n * H * S * d * 2 / 2**20)
