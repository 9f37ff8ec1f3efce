# ruff: noqa  (the README snippet is kept verbatim, as a user would paste it)
"""README.md:39-43 "One attention layer, directly", with the inputs the snippet leaves undefined filled in
(random k, v [B, T, Hkv, d] and q [B, Hq, d]; CertPolicy is imported by the first README snippet, not this one).
Sizes are small (T=300, not a multiple of the block, to exercise the residual block)."""
import jax
import jax.numpy as jnp

from certattn_jax import CertPolicy  # not imported by the snippet itself

B, T, Hkv, Hq, d = 2, 300, 2, 4, 64
k = jax.random.normal(jax.random.key(0), (B, T, Hkv, d), jnp.float32)
v = jax.random.normal(jax.random.key(1), (B, T, Hkv, d), jnp.float32)
q = jax.random.normal(jax.random.key(2), (B, Hq, d), jnp.float32)

# --- the snippet, verbatim ---
from certattn_jax import TieredKVCache, certified_attention, naive_attention, dense_attention, memory_report
cache = TieredKVCache.from_dense(k, v, policy=CertPolicy())   # k, v [B, T, Hkv, d]
out, cert = certified_attention(q, cache, CertPolicy())      # q [B, Hq, d]; cert.error_bound [B, Hq], .rung, .k_star, ...
# --- end ---

print("out", out.shape, "error_bound", cert.error_bound.shape, "rung", cert.rung.shape, "k_star", cert.k_star.shape)
assert out.shape == (B, Hq, d) and cert.error_bound.shape == (B, Hq)
ref = dense_attention(q, cache, CertPolicy())
nv = naive_attention(q, cache, CertPolicy())
err = jnp.linalg.norm(out - ref, axis=-1)
print("true error", err, "bound", cert.error_bound, "ok:", bool((err <= cert.error_bound).all()))
print("naive err", jnp.linalg.norm(nv - ref, axis=-1))
rep = memory_report(cache)
print("memory_report keys:", sorted(rep)[:20])
# the README's rule: TieredKVCache.from_dense(k, v, policy) + TieredModelCache.from_layers(...)
from certattn_jax import TieredModelCache
layers = [TieredKVCache.from_dense(k, v, CertPolicy()) for _ in range(2)]
mc = TieredModelCache.from_layers(layers, num_q_heads=Hq, policy=CertPolicy())
print("from_layers ->", type(mc).__name__, "mode", mc.mode, "capacity", mc.capacity,
      "host memory kind", mc.layers[0].host_k.sharding.memory_kind if hasattr(mc, "layers") else "?")
