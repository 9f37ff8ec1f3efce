"""hot_slots < k_max: a policy with 0 < hot_slots < k_max, and attending (eagerly, inside jit, and through a model
cache) a cache whose hot set has fewer slots than the attending policy's k_max, must be refused rather than run.

    .venv/bin/python scripts/soundness_probe/audit_2026_12_07_timevarying/probe_refusals.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from certattn_jax.attention import certified_attention_fast, certified_attention_step  # noqa: E402
from certattn_jax.cache import TieredKVCache  # noqa: E402
from certattn_jax.model_cache import TieredModelCache  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402

ok = True


def expect_refusal(name, fn):
    global ok
    try:
        fn()
    except (ValueError, TypeError) as e:
        print(f"refused  {name}: {type(e).__name__}: {str(e)[:140]}")
        return
    ok = False
    print(f"ACCEPTED {name}  <-- VIOLATION (hot_slots < k_max ran)")


expect_refusal("CertPolicy(k_max=4, hot_slots=2)", lambda: CertPolicy(block_size=16, group_size=16, k_max=4,
                                                                      hot_slots=2))
rng = np.random.default_rng(0)
k = jnp.asarray(rng.standard_normal((1, 70, 2, 16)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((1, 70, 2, 16)), jnp.bfloat16)
small = CertPolicy(block_size=16, group_size=16, k_max=2, v_max=2)
big = small.replace(k_max=4)
cache = TieredKVCache.from_dense(k, v, policy=small, capacity=96)
print("cache hot slots:", cache.k_max)
q = jnp.asarray(rng.standard_normal((1, 4, 16)), jnp.bfloat16)
expect_refusal("certified_attention_step eager, policy k_max 4 > 2 slots",
               lambda: certified_attention_step(q, cache, big))
expect_refusal("certified_attention_step jit, policy k_max 4 > 2 slots",
               lambda: jax.jit(certified_attention_step)(q, cache, big))
expect_refusal("certified_attention_fast jit, policy k_max 4 > 2 slots",
               lambda: jax.jit(certified_attention_fast, static_argnums=3)(q, cache, big, 1))
expect_refusal("TieredModelCache.from_layers(policy k_max 4 > 2 slots)",
               lambda: TieredModelCache.from_layers([cache], num_q_heads=4, policy=big))
m = TieredModelCache.from_layers([cache], num_q_heads=4, policy=small)
expect_refusal("TieredModelCache.replace(policy k_max 4).attend",
               lambda: jax.jit(lambda m: m.replace(policy=big).attend(
                   0, q[:, None], k[:, :1], v[:, :1], m.lengths + 1))(m))
print("RESULT", "all refused" if ok else "SOME ACCEPTED")
