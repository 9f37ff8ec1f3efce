"""The named MemoryError for a tier 2 beyond the host's available memory (`tiers.zeros_on_host`, reached through
`TieredKVCache.init`): does `stacked_from_layers` still raise it on its direct path (no preallocated cache), as it
does a layer at a time and in the loop form? Host memory faked small (tiers.host_memory_available -> 1000 bytes),
as tests/test_staging_groups.py::test_tier2_beyond_the_host_s_memory_is_named does.

    .venv/bin/python scripts/soundness_probe/review_2026_12_07_37th/host_check.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax.numpy as jnp
import numpy as np

from certattn_jax import cache as cm
from certattn_jax import tiers
from certattn_jax.policy import CertPolicy

POL = CertPolicy(block_size=16, group_size=16, k_max=4, v_max=2)
rng = np.random.default_rng(0)
ks = tuple(jnp.asarray(rng.normal(size=(2, 2, 48, 32)), jnp.float32) for _ in range(3))
vs = tuple(jnp.asarray(rng.normal(size=(2, 2, 48, 32)), jnp.float32) for _ in range(3))
lens = jnp.array([40, 7], jnp.int32)
tiers.host_memory_available = lambda: 1000  # tier 2 here: 3 * 2 * 2 * 48 * 32 * 4 = 73,728 bytes per array
REAL = cm.CONVERT_GROUP_BYTES
for name, form, budget in (("direct (default)", "batched", REAL), ("a layer at a time", "batched", 1),
                           ("loop form", "loop", REAL)):
    cm.CONVERT_GROUP_FORM, cm.CONVERT_GROUP_BYTES = form, budget
    try:
        c = cm.TieredKVCache.stacked_from_layers(ks, vs, lens, POL)
        print(f"{name:18s}: built, tier 2 {c.host_k.nbytes} bytes per array in {c.host_k.sharding.memory_kind} "
              "(no MemoryError)")
    except MemoryError as e:
        print(f"{name:18s}: MemoryError: {str(e)[:110]}")
