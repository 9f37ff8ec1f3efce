"""Per-rung accuracy of the exact rungs on the current backend (diagnostic)."""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")
from test_soundness import CFG_B, build, draw_data, reference  # noqa: E402

from certattn_jax.attention import certified_attention, dense_attention  # noqa: E402
from certattn_jax.policy import CertPolicy  # noqa: E402

attn = jax.jit(certified_attention, static_argnums=2)
print(jax.devices())
rng = np.random.default_rng(8)
B, T, H, G, d = 1, 200, 2, 2, 32
k = jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.bfloat16)
v = jnp.asarray(1000.0 + rng.standard_normal((B, T, H, d)), jnp.bfloat16)
q = jnp.asarray(rng.standard_normal((B, H * G, d)) * 0.3, jnp.float32)
pol = CertPolicy(block_size=16, group_size=16, k_max=3, eps=0.05)
ref = reference(q, k, v, [T])
for name, p in (("rung0", dataclasses.replace(pol, eps=10.0)),
                ("rung3", dataclasses.replace(pol, eps=0.0, layer_fallback_fraction=2.0)),
                ("rung4", dataclasses.replace(pol, eps=0.0, layer_fallback_fraction=0.1))):
    cache = build(k, v, jnp.array([T], jnp.int32), p, T)
    out, c = attn(q, cache, p)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref, axis=-1)
    print(name, "rung", np.asarray(c.rung).tolist(), "err", err.round(6).tolist(), "bound",
          np.asarray(c.error_bound).tolist())
dn = np.asarray(jax.jit(dense_attention)(q, cache), np.float64)
print("dense_attention err", np.linalg.norm(dn - ref, axis=-1).tolist())
cfg = CFG_B
q, k, v = draw_data(cfg, 12, q_scale=3.0, k_offset=100.0)
lengths = [cfg.cap - 5]
cache = build(k, v, jnp.asarray(lengths, jnp.int32), cfg.policy, cfg.cap)
out, c = attn(q, cache, cfg.policy)
ref = reference(q, k, v, lengths)
o = np.asarray(out, np.float64)
print("CFG_B keyoff rung", np.asarray(c.rung).tolist(), "nan heads", np.isnan(o).any(-1).tolist(), "err",
      np.linalg.norm(o - ref, axis=-1).tolist(), "bound", np.asarray(c.error_bound).tolist(),
      "e_key", np.asarray(c.e_key).tolist(), "e_num", np.asarray(c.e_num).tolist())
dn = np.asarray(jax.jit(dense_attention)(q, cache), np.float64)
print("CFG_B dense nan", np.isnan(dn).any(-1).tolist(), "err", np.linalg.norm(dn - ref, axis=-1).tolist())
